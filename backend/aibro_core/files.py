"""Files that hold secrets (tokens, credentials) are private from the first byte."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


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


def new_token(kind: str = "u") -> str:
    """A bearer token with a readable prefix (`aibro_u_…` for users, `aibro_w_…` for workers): it never begins
    with '-', so it can follow an option on any command line, and a secret scanner can recognise it."""
    return f"aibro_{kind}_{secrets.token_urlsafe(32)}"
