"""The users' API tokens: stored hashed, named by a public id, with an optional expiry and their last use."""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from typing import Any

from aibro_core.files import new_token

from .sql import write

TOKEN_TOUCH_S = 60.0  # last_used is written at most this often per token, so a polling client costs no writes


def token_id() -> str:
    """A token's public name: what `aibro token list` shows and `aibro token revoke` takes."""
    return "tok_" + secrets.token_hex(6)


def hash_token(token: str) -> str:
    """Tokens are stored hashed so a copy of the database grants nothing."""
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """The `tokens` table."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def new(self, user_id: int, expires_in_s: float | None = None) -> str:
        return self.mint(user_id, expires_in_s)["token"]

    def mint(self, user_id: int, expires_in_s: float | None = None) -> dict[str, Any]:
        """A new token for the user: the secret is returned once (only its hash is kept) with its public id."""
        token, now = new_token("u"), time.time()
        expires = None if expires_in_s is None else now + float(expires_in_s)
        tid = token_id()
        write(
            self.db,
            "INSERT INTO tokens (hash, user_id, created, id, expires) VALUES (?, ?, ?, ?, ?)",
            (hash_token(token), user_id, now, tid, expires),
        )
        return {"id": tid, "token": token, "created": now, "expires": expires}

    def user_for(self, token: str) -> dict[str, Any] | None:
        found = self.lookup(token)
        return {"id": found["user_id"], "name": found["name"]} if found and not found["expired"] else None

    def lookup(self, token: str) -> dict[str, Any] | None:
        """The token's row (id, user, expiry) whether expired or not, or None when unknown. Notes its last use."""
        row = self.db.execute(
            "SELECT tokens.id, tokens.user_id, users.name, tokens.expires, tokens.last_used, tokens.hash "
            "FROM tokens JOIN users ON users.id = tokens.user_id WHERE tokens.hash=?",
            (hash_token(token),),
        ).fetchone()
        if row is None:
            return None
        now = time.time()
        expired = row["expires"] is not None and row["expires"] <= now
        if not expired and (row["last_used"] is None or row["last_used"] < now - TOKEN_TOUCH_S):
            write(self.db, "UPDATE tokens SET last_used=? WHERE hash=?", (now, row["hash"]))
        return {
            "id": row["id"],
            "user_id": int(row["user_id"]),
            "name": row["name"],
            "expires": row["expires"],
            "expired": expired,
        }

    def list(self, user_id: int) -> list[dict[str, Any]]:
        """The user's live tokens, oldest first: ids and times, never the secret (nor its hash)."""
        rows = self.db.execute(
            "SELECT id, created, expires, last_used FROM tokens WHERE user_id=? AND (expires IS NULL OR expires>?) "
            "ORDER BY created",
            (user_id, time.time()),
        ).fetchall()
        return [dict(r) for r in rows]

    def live(self, user_id: int) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM tokens WHERE user_id=? AND (expires IS NULL OR expires>?)", (user_id, time.time())
        ).fetchone()
        return int(row[0])

    def revoke(self, user_id: int, token_id: str) -> bool:
        cur = write(self.db, "DELETE FROM tokens WHERE user_id=? AND id=?", (user_id, token_id))
        return cur.rowcount > 0

    def revoke_all(self, user_id: int) -> int:
        return write(self.db, "DELETE FROM tokens WHERE user_id=?", (user_id,)).rowcount

    def drop_expired(self, grace_s: float = 7 * 86400) -> int:
        """Expired tokens are kept a week (so a client still gets "expired", not "unknown"), then deleted."""
        return write(
            self.db, "DELETE FROM tokens WHERE expires IS NOT NULL AND expires<?", (time.time() - grace_s,)
        ).rowcount
