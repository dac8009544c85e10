"""Which agent this is: the backend's version plus a digest of the code of both packages, so two processes that
report the same version run the same code (an agent built from other code never passes for this one)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import aibro_core

from .. import __version__

PACKAGES = (Path(__file__).resolve().parents[1], Path(aibro_core.__file__).resolve().parent)
SKIP_SUFFIXES = (".pyc", ".pyo")
HEADER = "X-Agent-Version"  # what an agent sends with its enrollment and its polls


def code_files() -> list[tuple[str, Path]]:
    """(name in the wheel, file) for every file of the two packages, sorted."""
    out = []
    for root in PACKAGES:
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and not path.name.endswith(SKIP_SUFFIXES):
                out.append((f"{root.name}/{path.relative_to(root).as_posix()}", path))
    return sorted(out)


def version_of(files: list[tuple[str, Path]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return f"{__version__}+{digest.hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def agent_version() -> str:
    """This process's agent version (the code does not change under a running process)."""
    return version_of(code_files())
