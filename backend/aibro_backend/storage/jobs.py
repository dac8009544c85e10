"""The jobs: each one's spec as submitted, its state and progress (its events are in events.py)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.models import JobSpec

from .records import JobRecord, job_spec_text
from .sql import owned_rows, row_by_id, update_row, write


class Jobs:
    """The `jobs` table."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def create(self, job_id: str, user_id: int, spec: JobSpec, replay_of: str | None = None) -> None:
        now = time.time()
        write(
            self.db,
            "INSERT INTO jobs (id, user_id, status, substatus, spec, description, created, updated, replay_of) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                user_id,
                v.QUEUING,
                v.REQUESTING_SERVER,
                job_spec_text(spec),
                spec.description,
                now,
                now,
                replay_of,
            ),
        )

    def get(self, job_id: str, user_id: int | None = None) -> JobRecord | None:
        row = row_by_id(self.db, "jobs", job_id, user_id)
        return JobRecord.of(row) if row else None

    def state(self, job_id: str, user_id: int | None = None) -> tuple[str, str] | None:
        """The job's status and substatus alone (a long-poll asks this at every wake-up), or None when there is
        no such job (for this user, when one is given)."""
        row = self.db.execute(
            "SELECT status, substatus FROM jobs WHERE id=? AND (? IS NULL OR user_id=?)", (job_id, user_id, user_id)
        ).fetchone()
        return (row["status"], row["substatus"]) if row else None

    def list(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[JobRecord]:
        return [JobRecord.of(r) for r in owned_rows(self.db, "jobs", user_id, statuses)]

    def update(self, job_id: str, **fields: Any) -> None:
        update_row(self.db, "jobs", {"id": job_id}, fields)
