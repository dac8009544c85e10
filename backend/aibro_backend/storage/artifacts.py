"""The files a job stored (the bytes are blobs): by name, per job."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from .sql import write


class Artifacts:
    """The `artifacts` table."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def add(self, job_id: str, name: str, size: int, sha: str) -> None:
        write(
            self.db,
            "INSERT OR REPLACE INTO artifacts (job_id, name, size, sha, created) VALUES (?, ?, ?, ?, ?)",
            (job_id, name, size, sha, time.time()),
        )

    def newest(self, user_id: int, name: str) -> str | None:
        """The job of `user_id` that most recently stored an artifact `name`, or None."""
        row = self.db.execute(
            "SELECT a.job_id FROM artifacts a JOIN jobs j ON j.id = a.job_id WHERE j.user_id=? AND a.name=? "
            "ORDER BY a.created DESC LIMIT 1",
            (user_id, name),
        ).fetchone()
        return row["job_id"] if row else None

    def of_job(self, job_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT name, size, sha, created FROM artifacts WHERE job_id=? ORDER BY name", (job_id,)
        ).fetchall()
        return [dict(r) for r in rows]
