"""Users of a shared backend: the admin mints a user's token on the backend's host, the user runs `aibro login`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from aibro_core.errors import AibroError, ValidationError

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


def main(argv: list[str] | None = None) -> int:
    """`python -m aibro_backend.accounts add-user NAME`: what `aibro backend add-user NAME` runs."""
    parser = argparse.ArgumentParser(prog="aibro backend add-user", description="Mint a token for a user.")
    parser.add_argument("action", choices=["add-user"])
    parser.add_argument("name")
    parser.add_argument("--home", default=os.environ.get("AIBRO_HOME", str(Path.home() / ".aibro")))
    args = parser.parse_args(argv)
    try:
        token = add_user(Path(args.home), args.name)
    except AibroError as exc:
        print(f"aibro: {exc}", file=sys.stderr)
        return 2
    print(f"user {args.name}: token {token}")
    print(f"give it to {args.name} once (it is stored hashed); they run: aibro login BACKEND_URL --token-stdin")
    print(f"  or, where a token on the command line is acceptable: aibro login BACKEND_URL --token={token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
