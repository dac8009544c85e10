"""The users, and what each has used so far (counters)."""

from __future__ import annotations

import sqlite3
import time

from .sql import write


class Users:
    """The `users` and `counters` tables."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM users").fetchone()[0])

    def ensure(self, name: str) -> int:
        row = self.db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
        if row:
            return int(row["id"])
        cur = write(self.db, "INSERT INTO users (name, created) VALUES (?, ?)", (name, time.time()))
        return int(cur.lastrowid)

    def name_of(self, user_id: int) -> str | None:
        row = self.db.execute("SELECT name FROM users WHERE id=?", (user_id,)).fetchone()
        return str(row["name"]) if row else None

    def id_of(self, name: str) -> int | None:
        row = self.db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
        return int(row["id"]) if row else None

    def bump(self, user_id: int, name: str, amount: int) -> None:
        write(
            self.db,
            "INSERT INTO counters (user_id, name, value) VALUES (?, ?, ?) "
            "ON CONFLICT (user_id, name) DO UPDATE SET value = value + excluded.value",
            (user_id, name, amount),
        )

    def counters(self, user_id: int) -> dict[str, int]:
        rows = self.db.execute("SELECT name, value FROM counters WHERE user_id=?", (user_id,)).fetchall()
        return {r["name"]: int(r["value"]) for r in rows}
