"""Files that hold secrets (tokens, credentials) are private from the first byte; so are the folders and logs of
workers, whatever the umask they run under or what an older version left."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import BinaryIO


def write_private(path: Path, data: dict | str) -> None:
    """Secrets (a dict as JSON, or text) are 0600 from the first byte, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask
    with os.fdopen(fd, "w") as f:
        if isinstance(data, str):
            f.write(data)
        else:
            json.dump(data, f)
    os.replace(tmp, path)


def private_dir(path: Path) -> Path:
    """A folder only its owner reaches (0700): made so, or made so again when it was left open before. Every folder
    made on the way to it is 0700 as well: a mode given at creation, never left to the process's umask."""
    missing = [above for above in path.parents if not above.exists()]  # folders already there stay as they are
    for above in reversed(missing):
        try:
            above.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process: left as it is
            continue
        os.chmod(above, 0o700)
    path.mkdir(exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def open_private_log(path: Path) -> BinaryIO:
    """A log file to append to, 0600 whatever the umask and whoever made it before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def new_token(kind: str = "u") -> str:
    """A bearer token with a readable prefix (`aibro_u_…` for users, `aibro_w_…` for workers): it never begins
    with '-', so it can follow an option on any command line, and a secret scanner can recognise it."""
    return f"aibro_{kind}_{secrets.token_urlsafe(32)}"


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, read 1 MiB at a time (the one hashing of whole files on both sides)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
