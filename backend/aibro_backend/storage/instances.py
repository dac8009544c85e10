"""The instances: machines held for a user, the worker token and one-time enrollment each authenticates with, and
every transition of each (what costs.py bills from)."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.files import new_token

from .records import InstanceRecord
from .sql import owned_rows, row_by_id, update_row, write
from .tokens import hash_token

ENROLL_TTL_S = 3600.0  # a one-time enrollment token not used within this is refused (the instance is relaunched)


class Instances:
    """The `instances` table."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def create(
        self,
        instance_id: str,
        user_id: int,
        provider: str,
        machine_id: str,
        token: str,
        cool_down_s: float,
        enroll_token: str | None = None,
        enroll_ttl_s: float = ENROLL_TTL_S,
        price_per_hour: float = 0.0,
    ) -> None:
        """A new LAUNCHING instance whose worker authenticates with `token`, or, when `enroll_token` is given
        (a machine whose user data anyone on it can read), first exchanges that one-time token for its own
        (`enroll`); `token` is then never handed out. Only hashes are kept. `price_per_hour` is what it is billed
        at (costs.py)."""
        now = time.time()
        enroll_hash = hash_token(enroll_token) if enroll_token else None
        enroll_expires = now + enroll_ttl_s if enroll_token else None
        write(
            self.db,
            "INSERT INTO instances (id, user_id, provider, machine_id, status, token_hash, cool_down_s, created, "
            "updated, history, enroll_hash, enroll_expires, price_per_hour) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                instance_id,
                user_id,
                provider,
                machine_id,
                v.LAUNCHING,
                hash_token(token),
                cool_down_s,
                now,
                now,
                json.dumps([[v.LAUNCHING, "", now]]),
                enroll_hash,
                enroll_expires,
                price_per_hour,
            ),
        )

    def enroll(self, enroll_token: str) -> tuple[InstanceRecord | None, str]:
        """Exchange a one-time enrollment token for the instance's worker token: (instance, token) once; after
        that, or once expired, or for a closed instance, (None, why). The enrollment token is burnt by its use and
        the new worker token replaces whatever the instance had (only its hash is kept)."""
        h = hash_token(enroll_token)
        row = self.db.execute("SELECT * FROM instances WHERE enroll_hash=?", (h,)).fetchone()
        if row is None:
            return None, "unknown or already used enrollment token"
        if (row["enroll_expires"] or 0) <= time.time():
            write(self.db, "UPDATE instances SET enroll_hash=NULL WHERE id=?", (row["id"],))
            return None, "the enrollment token expired: the instance must be launched again"
        if row["status"] in (v.CLOSING, v.CLOSED):
            write(self.db, "UPDATE instances SET enroll_hash=NULL WHERE id=?", (row["id"],))
            return None, f"instance {row['id']} is {row['status']}"
        token = new_token("w")
        cur = write(
            self.db,
            "UPDATE instances SET token_hash=?, enroll_hash=NULL, enroll_expires=NULL, last_seen=? "
            "WHERE id=? AND enroll_hash=?",
            (hash_token(token), time.time(), row["id"], h),
        )
        if cur.rowcount != 1:  # another request used it first
            return None, "unknown or already used enrollment token"
        return self.get(row["id"]), token

    def for_enroll(self, enroll_token: str) -> InstanceRecord | None:
        """The live instance whose enrollment token this is, unused and unexpired (the token is not burnt)."""
        row = self.db.execute("SELECT * FROM instances WHERE enroll_hash=?", (hash_token(enroll_token),)).fetchone()
        if row is None or (row["enroll_expires"] or 0) <= time.time() or row["status"] in (v.CLOSING, v.CLOSED):
            return None
        return InstanceRecord.of(row)

    def get(self, instance_id: str, user_id: int | None = None) -> InstanceRecord | None:
        row = row_by_id(self.db, "instances", instance_id, user_id)
        return InstanceRecord.of(row) if row else None

    def for_token(self, token: str) -> InstanceRecord | None:
        row = self.db.execute("SELECT * FROM instances WHERE token_hash=?", (hash_token(token),)).fetchone()
        return InstanceRecord.of(row) if row else None

    def list(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[InstanceRecord]:
        return [InstanceRecord.of(r) for r in owned_rows(self.db, "instances", user_id, statuses)]

    def set_state(self, instance_id: str, status: str, substatus: str = "", **fields: Any) -> None:
        """Move an instance to a new state and timestamp the transition in its history: [status, substatus, ts,
        job_id], the job it holds from then on (what costs.py bills each job for)."""
        inst = self.get(instance_id)
        if inst is None:
            raise KeyError(instance_id)
        now = time.time()
        history = list(inst.history)
        job = fields.get("job_id", inst.job_id)
        last = history[-1] if history else None
        if last is not None and last[:2] == [status, substatus] and len(last) < 4 and job:
            history[-1] = [*last[:3], job]  # the job is bound just after the row is made (same state)
        elif last is None or last[:2] != [status, substatus] or (len(last) > 3 and last[3] != job):
            history.append([status, substatus, now, job])
        fields.update(status=status, substatus=substatus, history=json.dumps(history))
        update_row(self.db, "instances", {"id": instance_id}, fields, now)

    def update(self, instance_id: str, **fields: Any) -> None:
        update_row(self.db, "instances", {"id": instance_id}, fields)
