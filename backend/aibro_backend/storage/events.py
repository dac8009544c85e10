"""The event log: every job's events with gap-free seqs, appended in batches under one commit, read back encoded
as the API answers them (from the recent windows when they reach back far enough, recent.py).

A study keeps its own log here too (issue 40): its `study` events under the study's id where a job's events have
the job's (the `job_id` column names the log), with the same seqs, windows, long-polls and user stream."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from typing import Any, NamedTuple

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture
from aibro_core.jsonout import dumps

from .recent import RecentEvents, encode_event
from .sql import marks, transaction
from .walcheckpoint import Checkpointer

log = logging.getLogger(__name__)


class NewEvent(NamedTuple):
    """An event to append: its type and data, the worker's wseq (deduplicates a resent batch), its timestamp."""

    type: str
    data: dict[str, Any]
    wseq: int | None = None
    ts: float | None = None


class NoSuchJob(KeyError):
    """Events for a job (or a study) that is not (or no longer) in the store."""


class EventBatch(NamedTuple):
    """One job's events to append together; `from_worker`: its status events never move a job that has ended
    (a worker's post is checked against the job before it waits for the group commit)."""

    job_id: str
    events: list[NewEvent]
    attempt: int | None = None
    from_worker: bool = False


class Events:
    """The `events` table, and the job row a status or epoch event moves (in the same transaction)."""

    def __init__(self, db: sqlite3.Connection, checkpointer: Checkpointer | None) -> None:
        self.db = db
        self.recent = RecentEvents()
        self.checkpointer = checkpointer

    def append(
        self,
        job_id: str,
        type_: str,
        data: dict[str, Any],
        *,
        attempt: int | None = None,
        wseq: int | None = None,
        ts: float | None = None,
    ) -> dict[str, Any] | None:
        """Append one event with the next gap-free seq; a worker event already stored returns None.

        A status event also moves the job's status/substatus, in the same transaction.
        """
        stored = self.append_many(job_id, [NewEvent(type_, data, wseq, ts)], attempt=attempt)
        return stored[0] if stored else None

    def append_many(self, job_id: str, events: list[NewEvent], *, attempt: int | None = None) -> list[dict[str, Any]]:
        """Append a batch in one transaction (one fsync for a worker's whole batch). Gap-free seqs in order;
        events whose wseq this attempt already stored are skipped (a resent batch); status and epoch events move
        the job's row in the same transaction. Returns the events stored."""
        result = self.append_batches([EventBatch(job_id, events, attempt)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def append_batches(self, batches: list[EventBatch]) -> list[list[dict[str, Any]] | Exception]:
        """Append several jobs' batches in one transaction with one fsync (group commit: what lets the backend
        take thousands of worker events a second with the log durable). Each batch runs under a savepoint of its
        own, so one that fails (its job deleted meanwhile) is rolled back alone and answered with its exception;
        the others commit. A commit that fails fails them all. Returns, per batch, the events stored or the
        exception; the recent windows get the batches in commit order."""
        done: list[tuple[str, int, int, list[tuple[int, int, bytes]]] | None] = []
        results: list[list[dict[str, Any]] | Exception] = []
        with transaction(self.db):
            for batch in batches:
                try:
                    with transaction(self.db):  # a savepoint: this batch alone is rolled back when it fails
                        published, stored = self._append_in_transaction(batch)
                except Exception as exc:  # noqa: BLE001 - this batch's answer; the others go on
                    done.append(None)
                    results.append(exc)
                    continue
                done.append(published)
                results.append(stored)
        for published in done:
            if published is not None:
                self.recent.add(*published)
        if self.checkpointer is not None and self.checkpointer.rewind_wanted:
            self._rewind_wal()
        return results

    def _append_in_transaction(
        self, batch: EventBatch
    ) -> tuple[tuple[str, int, int, list[tuple[int, int, bytes]]], list[dict[str, Any]]]:
        """One batch inside an open transaction: what the recent windows get, and the events stored."""
        job_id, events, attempt = batch.job_id, batch.events, batch.attempt
        job = self.db.execute("SELECT user_id, status, substatus FROM jobs WHERE id=?", (job_id,)).fetchone()
        if job is None:
            uid = self._study_owner(job_id, events)
            picture = None
        else:
            uid = job["user_id"]
            if any(ev.type == v.EV_STUDY for ev in events):
                raise ValueError(f"a {v.EV_STUDY} event goes to its study's log, not to job {job_id}'s")
            if batch.from_worker and job["status"] not in v.JOB_ACTIVE:
                events = [ev for ev in events if ev.type != v.EV_STATUS]  # a worker's events never move an ended job
            picture = JobPicture(job["status"], job["substatus"])  # the job's row, as the reducer has it
        seq = seq_before = self.db.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id=?", (job_id,)
        ).fetchone()[0]
        moved = None
        seen = self._stored_wseqs(job_id, attempt, [ev.wseq for ev in events if ev.wseq is not None])
        kept: list[tuple[NewEvent, int, float, str]] = []  # (event, seq, ts, its data as JSON)
        for ev in events:
            if ev.wseq is not None:
                if ev.wseq in seen:
                    continue
                seen.add(ev.wseq)
            seq += 1
            ts = time.time() if ev.ts is None else ev.ts
            kept.append((ev, seq, ts, dumps(ev.data)))  # standard JSON in the log: what the API answers
            if (
                picture is not None
                and ev.type in (v.EV_STATUS, v.EV_EPOCH)
                and picture.apply({"type": ev.type, "data": ev.data, "ts": ts})
            ):
                moved = ts
        self.db.executemany(
            "INSERT INTO events (job_id, user_id, seq, type, ts, data, attempt, wseq) VALUES (?,?,?,?,?,?,?,?)",
            [(job_id, uid, s, ev.type, ts, data_json, attempt, ev.wseq) for ev, s, ts, data_json in kept],
        )
        if picture is not None and moved is not None:  # the job's row as the batch leaves it, same transaction
            self.db.execute(
                "UPDATE jobs SET status=?, substatus=?, epochs_done=MAX(epochs_done, ?), updated=? WHERE id=?",
                (picture.status, picture.substatus, picture.epochs_done, moved, job_id),
            )
        # AUTOINCREMENT under BEGIN IMMEDIATE (this connection the only writer): the batch's gids are the n
        # numbers up to the last one inserted
        last_gid = self.db.execute("SELECT last_insert_rowid()").fetchone()[0] if kept else 0
        first_gid = last_gid - len(kept) + 1
        parts = [
            (first_gid + i, s, encode_event(first_gid + i, job_id, s, ev.type, ts, data_json))
            for i, (ev, s, ts, data_json) in enumerate(kept)
        ]
        stored = [
            {"gid": gid, "job_id": job_id, "seq": s, "type": ev.type, "ts": ts, "data": ev.data, "user_id": uid}
            for (gid, s, _), (ev, _, ts, _) in zip(parts, kept)
        ]
        return (job_id, uid, seq_before, parts), stored

    def _study_owner(self, study_id: str, events: list[NewEvent]) -> int:
        """The user whose study's log `study_id` is; a study's log holds its `study` events only."""
        study = self.db.execute("SELECT user_id FROM studies WHERE id=?", (study_id,)).fetchone()
        if study is None:
            raise NoSuchJob(study_id)
        if any(ev.type != v.EV_STUDY for ev in events):
            raise ValueError(f"study {study_id}'s log takes {v.EV_STUDY} events only")
        return int(study["user_id"])

    def _rewind_wal(self) -> None:
        """A RESTART checkpoint between two batches, from the writer itself (see walcheckpoint.Checkpointer): the
        frames since the last PASSIVE round are copied and the next commit writes the WAL from its start."""
        self.checkpointer.rewind_wanted = False
        try:
            self.db.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
        except sqlite3.Error as exc:  # busy: the checkpointer asks again after its next round
            log.debug("WAL rewind deferred: %s", exc)

    def _stored_wseqs(self, job_id: str, attempt: int | None, wseqs: list[int]) -> set[int]:
        """Which of these worker seqs this attempt already stored: one indexed range read per batch."""
        if not wseqs:
            return set()
        rows = self.db.execute(
            "SELECT wseq FROM events WHERE job_id=? AND attempt=? AND wseq BETWEEN ? AND ?",
            (job_id, attempt, min(wseqs), max(wseqs)),
        )
        return {r[0] for r in rows}

    def parts(self, job_id: str, after: int = 0, limit: int = 5000) -> list[bytes]:
        """The job's events after seq `after`, encoded as the API answers them: from the recent window when it
        reaches back that far (no query, no encoding: what a long-poll under load needs), else from the log."""
        parts = self.recent.job_events(job_id, after, limit)
        if parts is not None:
            return parts
        return [encode_event(*row) for row in self._logged("job_id", job_id, "seq", after, limit)]

    def user_parts(self, user_id: int, after: int = 0, limit: int = 5000) -> tuple[list[bytes], int]:
        """The user's events after gid `after` (encoded, as `event_parts`) and the cursor to follow from."""
        found = self.recent.user_events(user_id, after, limit)
        if found is None:
            rows = self._logged("user_id", user_id, "gid", after, limit)
            found = [row[0] for row in rows], [encode_event(*row) for row in rows]
        gids, parts = found
        return parts, gids[-1] if gids else after

    def _logged(self, owner: str, value: Any, key: str, after: int, limit: int) -> list[sqlite3.Row]:
        """Events read from the log itself: those of `owner` (job_id or user_id) after `after` in `key` order."""
        return self.db.execute(
            f"SELECT gid, job_id, seq, type, ts, data FROM events WHERE {owner}=? AND {key}>? ORDER BY {key} LIMIT ?",
            (value, after, limit),
        ).fetchall()

    def typed(self, job_id: str, types: tuple[str, ...]) -> list[dict[str, Any]]:
        """Every event of these types (its timeline, its epochs), however long the job's log is."""
        rows = self.db.execute(
            f"SELECT * FROM events WHERE job_id=? AND type IN ({marks(types)}) ORDER BY seq",
            (job_id, *types),
        ).fetchall()
        return [_event_row(r) for r in rows]

    def max_gid(self, user_id: int) -> int:
        """The user's newest event: a watcher that lists jobs, then follows from here, misses nothing."""
        row = self.db.execute("SELECT COALESCE(MAX(gid), 0) FROM events WHERE user_id=?", (user_id,)).fetchone()
        return int(row[0])

    def max_wseq(self, job_id: str, attempt: int) -> int:
        row = self.db.execute(
            # `wseq IS NOT NULL` lets SQLite use the partial index (else it reads every event of the job)
            "SELECT COALESCE(MAX(wseq), 0) FROM events WHERE job_id=? AND attempt=? AND wseq IS NOT NULL",
            (job_id, attempt),
        ).fetchone()
        return int(row[0])


def _event_row(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "gid": row["gid"],
        "job_id": row["job_id"],
        "seq": row["seq"],
        "type": row["type"],
        "ts": row["ts"],
        "data": json.loads(row["data"]),
    }
