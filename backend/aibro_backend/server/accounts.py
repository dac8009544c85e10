"""Users of a shared backend: the admin mints a user's token on the backend's host, the user runs `aibro login`."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

from aibro_core.errors import AibroError, ValidationError

from ..scheduling.policy import Policy
from ..settings import BackendSettings
from ..storage.store import Store
from .limits import Limits

MAX_EXPIRES_IN_S = 10 * 365 * 86400.0

USER_NAME_RE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


def store_path(home: Path) -> Path:
    """The backend's SQLite file under its home: the one place both the service and admin commands open."""
    return Path(home) / "state" / "aibro.db"


def _open_store(home: Path) -> Store:
    path = store_path(home)
    if not path.exists():
        raise ValidationError(
            f"no backend store at {path}: run this on the backend's host, with the same AIBRO_HOME as "
            "`aibro backend serve`, after the backend has started once"
        )
    return Store(path)


def add_user(home: Path, name: str, expires_in_s: float | None = None) -> str:
    """Make user `name` if new and return a fresh token for it (expiring after `expires_in_s` when given). Only its
    hash is stored, so it is shown once. A user holds at most Limits.max_tokens_per_user live tokens."""
    if not isinstance(name, str) or not USER_NAME_RE.fullmatch(name):
        raise ValidationError(
            f"user name {name!r} is not valid: use 1-64 characters, lowercase letters, digits, '_', '.', '-', "
            "starting with a letter (e.g. alice)"
        )
    if expires_in_s is not None and not (math.isfinite(expires_in_s) and 0 < expires_in_s <= MAX_EXPIRES_IN_S):
        raise ValidationError(f"--expires-in must be a number of seconds above 0 and at most {MAX_EXPIRES_IN_S:.0f}")
    store = _open_store(home)
    try:
        uid = store.users.ensure(name)
        cap = Limits.from_env(Policy.from_env()).max_tokens_per_user
        live = store.tokens.live(uid)
        if live >= cap:
            raise ValidationError(
                f"{name} holds {live} live tokens, the limit: revoke them all with `aibro backend revoke-tokens "
                f"{name}`, or {name} revokes unused ones (`aibro token list`, `aibro token revoke ID`)"
            )
        return store.tokens.new(uid, expires_in_s)
    finally:
        store.close()


def revoke_tokens(home: Path, name: str) -> int:
    """Revoke every token of user `name` (a lost laptop, a leaver); returns how many there were."""
    store = _open_store(home)
    try:
        uid = store.users.id_of(name)
        if uid is None:
            raise ValidationError(f"no user {name!r} on this backend")
        return store.tokens.revoke_all(uid)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m aibro_backend.server.accounts add-user NAME`: what `aibro backend add-user NAME` runs (and
    `revoke-tokens NAME`, what `aibro backend revoke-tokens NAME` runs)."""
    os.umask(0o077)  # a database file or WAL this makes is the backend's alone
    parser = argparse.ArgumentParser(prog="aibro backend", description="Mint or revoke a user's tokens.")
    parser.add_argument("action", choices=["add-user", "revoke-tokens"])
    parser.add_argument("name")
    parser.add_argument("--home", help="the backend's folder (default: AIBRO_HOME, else ~/.aibro)")
    parser.add_argument("--expires-in", type=float, default=None, metavar="S", help="the token expires after S seconds")
    args = parser.parse_args(argv)
    args.home = args.home or BackendSettings.from_env().home
    try:
        if args.action == "revoke-tokens":
            count = revoke_tokens(Path(args.home), args.name)
            print(f"user {args.name}: {count} token(s) revoked")
            return 0
        token = add_user(Path(args.home), args.name, args.expires_in)
    except AibroError as exc:
        print(f"aibro: {exc}", file=sys.stderr)
        return 2
    until = ""
    if args.expires_in is not None:
        until = time.strftime(" (expires %Y-%m-%d %H:%M:%S UTC)", time.gmtime(time.time() + args.expires_in))
    print(f"user {args.name}: token {token}{until}")
    print(f"give it to {args.name} once (it is stored hashed); they run: aibro login BACKEND_URL --token-stdin")
    print(f"  or, where a token on the command line is acceptable: aibro login BACKEND_URL --token={token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
