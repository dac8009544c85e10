"""Users of a shared backend: the admin mints a user's token on the backend's host, the user runs `aibro login`."""

from __future__ import annotations

import re
from pathlib import Path

from aibro_jupyter.errors import ValidationError

from .store import Store

USER_NAME_RE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


def store_path(home: Path) -> Path:
    """The backend's SQLite file under its home: the one place both the service and admin commands open."""
    return Path(home) / "state" / "aibro.db"


def add_user(home: Path, name: str) -> str:
    """Make user `name` if new and return a fresh token for it. Only its hash is stored, so it is shown once."""
    if not isinstance(name, str) or not USER_NAME_RE.fullmatch(name):
        raise ValidationError(
            f"user name {name!r} is not valid: use 1-64 characters, lowercase letters, digits, '_', '.', '-', "
            "starting with a letter (e.g. alice)"
        )
    path = store_path(home)
    if not path.exists():
        raise ValidationError(
            f"no backend store at {path}: run this on the backend's host, with the same AIBRO_HOME as "
            "`aibro backend serve`, after the backend has started once"
        )
    store = Store(path)
    try:
        return store.new_token(store.ensure_user(name))
    finally:
        store.close()
