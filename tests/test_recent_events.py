"""The encoded window of recent events (aibro_backend/storage/recent.py): a long-poll answered from it must be
exactly the page the event log gives, for every cursor, across trimming, restarts, rolled-back batches and users."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from records import job_spec

from aibro_backend.storage import recent
from aibro_backend.storage.events import EventBatch, NewEvent, NoSuchJob
from aibro_backend.storage.groupcommit import GroupCommit
from aibro_backend.storage.store import Store
from aibro_backend.storage.walcheckpoint import Checkpointer

pytestmark = pytest.mark.fast

SPEC = job_spec(fit={"epochs": 1000})


@pytest.fixture
def log(store: Store) -> Iterator[Store]:
    """A second store on the same database, which never appends: its windows are empty, so every page it gives
    comes from the log itself. The window of `store` must give the same bytes."""
    s = Store(store.path)
    yield s
    s.close()


def batch(n: int, start: int) -> list[NewEvent]:
    return [NewEvent("log", {"message": f"m{i}", "i": i}, wseq=i, ts=1000.0 + i) for i in range(start, start + n)]


def seqs(parts: list[bytes]) -> list[int]:
    return [json.loads(p)["seq"] for p in parts]


def test_every_cursor_reads_the_same_page_from_the_window_and_the_log(store: Store, log: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    for start in range(1, 60, 7):
        store.events.append_many("job-a", batch(7, start), attempt=0)
    assert store.events.recent.job_events("job-a", 0, 5000) is not None, "the window covers a job it saw from its start"
    assert log.events.recent.job_events("job-a", 0, 5000) is None, "the log reader has no window"
    for after in range(0, 66):
        assert store.events.parts("job-a", after) == log.events.parts("job-a", after), after
    assert seqs(store.events.parts("job-a", 0)) == list(range(1, 64))
    assert seqs(store.events.parts("job-a", 60)) == [61, 62, 63] and store.events.parts("job-a", 63) == []
    assert store.events.parts("job-a", 10, limit=3) == log.events.parts("job-a", 10, limit=3)
    assert seqs(store.events.parts("job-a", 10, limit=3)) == [11, 12, 13]


def test_a_trimmed_window_sends_older_cursors_to_the_log(
    store: Store, log: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recent, "WINDOW_EVENTS", 10)
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    for start in range(1, 100, 9):
        store.events.append_many("job-a", batch(9, start), attempt=0)
    assert store.events.recent.job_events("job-a", 0, 5000) is None, "the start of the job left the window"
    assert store.events.recent.job_events("job-a", 95, 5000) is not None
    for after in range(0, 100):
        assert store.events.parts("job-a", after) == log.events.parts("job-a", after), after
    parts, cursor = store.events.user_parts(uid, 0)
    assert (parts, cursor) == log.events.user_parts(uid, 0) and seqs(parts) == list(range(1, 100))
    assert cursor == json.loads(parts[-1])["gid"]


def test_a_restarted_store_reads_what_it_did_not_write_from_the_log(store: Store, log: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    store.events.append_many("job-a", batch(5, 1), attempt=0)
    restarted = Store(store.path)
    try:
        restarted.events.append_many("job-a", batch(5, 6), attempt=0)
        assert restarted.events.recent.job_events("job-a", 4, 5000) is None, "its window starts at its first append"
        for after in range(0, 11):
            assert restarted.events.parts("job-a", after) == log.events.parts("job-a", after)
        assert seqs(restarted.events.parts("job-a", 0)) == list(range(1, 11))
    finally:
        restarted.close()


def test_a_rolled_back_batch_never_reaches_the_window(store: Store, log: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    store.events.append_many("job-a", batch(3, 1), attempt=0)
    with pytest.raises(TypeError):  # data that is not JSON fails inside the transaction
        not_json = NewEvent("epoch", {"epoch": 0, "logs": {}, "x": {1}}, wseq=6)
        store.events.append_many("job-a", [*batch(2, 4), not_json], attempt=0)
    assert seqs(store.events.parts("job-a", 0)) == [1, 2, 3]
    store.events.append_many("job-a", batch(2, 4), attempt=0)
    assert store.events.parts("job-a", 0) == log.events.parts("job-a", 0)
    assert seqs(store.events.parts("job-a", 0)) == [1, 2, 3, 4, 5]


def test_resent_events_are_not_repeated(store: Store, log: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    store.events.append_many("job-a", batch(4, 1), attempt=0)
    store.events.append_many("job-a", batch(6, 1), attempt=0)  # the worker resends 1-4 with 5-6
    assert [json.loads(p)["data"]["i"] for p in store.events.parts("job-a", 0)] == [1, 2, 3, 4, 5, 6]
    assert store.events.parts("job-a", 0) == log.events.parts("job-a", 0)


def test_user_pages_are_scoped_and_match_the_log(store: Store, log: Store) -> None:
    alice, bob = store.users.ensure("alice"), store.users.ensure("bob")
    for job, uid in (("job-a", alice), ("job-b", alice), ("job-c", bob)):
        store.jobs.create(job, uid, SPEC)
    for round_ in range(4):
        for job in ("job-a", "job-c", "job-b"):
            store.events.append_many(job, batch(3, 1 + 3 * round_), attempt=0)
    for uid, jobs in ((alice, {"job-a", "job-b"}), (bob, {"job-c"})):
        everything = [json.loads(p) for p in store.events.user_parts(uid, 0)[0]]
        assert {e["job_id"] for e in everything} == jobs and len(everything) == 12 * len(jobs)
        for cursor in [0] + [e["gid"] for e in everything]:
            page = store.events.user_parts(uid, cursor)
            assert page == log.events.user_parts(uid, cursor)
            assert [json.loads(p)["gid"] for p in page[0]] == [e["gid"] for e in everything if e["gid"] > cursor]


def test_nan_and_infinity_go_out_as_null_from_window_and_log(store: Store, log: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    store.events.append_many("job-a", [NewEvent("log", {"loss": math.nan, "x": [math.inf, 1.5]}, wseq=1)], attempt=0)
    # a row as an older backend stored it, NaN and all (json.dumps writes them): only the log path meets it
    store.db.execute(
        "INSERT INTO events (job_id, user_id, seq, type, ts, data) VALUES (?, ?, ?, ?, ?, ?)",
        ("job-a", uid, 2, "log", 1.0, json.dumps({"loss": math.nan, "x": [-math.inf, 2.5]})),
    )
    (part,) = store.events.parts("job-a", 0)  # the window: the event this store appended
    assert json.loads(part)["data"] == {"loss": None, "x": [None, 1.5]}
    first, old = log.events.parts("job-a", 0)
    assert first == part
    assert json.loads(old, parse_constant=pytest.fail)["data"] == {"loss": None, "x": [None, 2.5]}
    assert log.events.user_parts(uid, json.loads(first)["gid"])[0] == [old]


def test_windows_are_bounded(store: Store, log: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recent, "WINDOWS", 4)
    monkeypatch.setattr(recent, "WINDOW_BYTES", 2000)
    monkeypatch.setattr(recent, "BUDGET_BYTES", 5000)
    uid = store.users.ensure("u")
    for j in range(6):
        store.jobs.create(f"job-{j}", uid, SPEC)
        store.events.append_many(f"job-{j}", batch(40, 1), attempt=0)
        windows = store.events.recent._windows
        assert len(windows) <= 4 and all(w.size <= 2000 for w in windows.values())
        assert store.events.recent.size == sum(w.size for w in windows.values()) <= 5000
    for j in range(6):
        assert store.events.parts(f"job-{j}", 0) == log.events.parts(f"job-{j}", 0)
        assert seqs(store.events.parts(f"job-{j}", 0)) == list(range(1, 41))


def test_checkpoints_off_the_request_path_keep_the_log_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With checkpoints on their own thread (the backend's setting) no commit copies the WAL into the database,
    yet the WAL stays bounded while events stream in without a pause (each batch begins while the last checkpoint
    runs, so PASSIVE alone never lets SQLite rewind the WAL: past the limit the writer runs one RESTART between two
    batches), and a closed store leaves every event in the database file itself (an empty WAL), readable by a fresh
    store."""
    monkeypatch.setattr(Checkpointer, "RESTART_ABOVE", 2 << 20)
    s = Store(tmp_path / "db.sqlite", checkpoints_every_s=0.05)
    s.users.ensure("u")
    s.jobs.create("job-1", 1, job_spec())
    assert s.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    wal = Path(f"{s.path}-wal")
    biggest, rewinds, last_seq = 0, 0, None
    for n in range(200):  # ~90 MB of WAL frames, as fast as the store takes them
        s.events.append_many("job-1", [NewEvent("log", {"message": "x" * 2000, "n": n * 100 + k}) for k in range(100)])
        biggest = max(biggest, wal.stat().st_size)
        with open(wal, "rb") as f:
            seq = f.read(16)[12:16]  # the WAL header's checkpoint sequence: it counts rewinds
        rewinds += last_seq is not None and seq != last_seq
        last_seq = seq
    assert rewinds >= 3, f"the WAL was rewound {rewinds} times while ~90 MB went through it"
    assert biggest < 40 << 20, f"the WAL grew to {biggest} bytes: nothing checkpointed it"
    s.close()
    assert not wal.exists() or wal.stat().st_size == 0
    fresh = Store(tmp_path / "db.sqlite")
    assert len(fresh.events.parts("job-1", 0, 30_000)) == 20_000
    fresh.close()


def test_a_lasting_checkpoint_failure_is_logged_once_and_its_end_noted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint that keeps failing (a full disk, no descriptors left) is a warning when it starts, not one per
    round; the round that works again says so. The thread's files are open before the store returns, so a flood of
    connections taking every descriptor later cannot stop checkpoints (tests/test_resources.py shows that end to
    end)."""
    s = Store(tmp_path / "db.sqlite", checkpoints_every_s=0.02)
    real = s._checkpointer._db
    failing = {"on": True}

    class Flaky:
        def execute(self, sql: str):  # noqa: ANN202 - stands in for sqlite3.Connection.execute
            if failing["on"]:
                raise sqlite3.OperationalError("unable to open database file")
            return real.execute(sql)

        def close(self) -> None:
            real.close()

    caplog.set_level(logging.INFO, logger="aibro_backend.storage.walcheckpoint")
    s._checkpointer._db = Flaky()
    time.sleep(0.5)  # ~25 failed rounds
    failing["on"] = False
    time.sleep(0.2)
    s.close()
    said = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage()]
    assert len([m for m in said if "failed" in m]) == 1, said
    assert "unable to open database file" in said[0]
    assert any("works again" in m for m in said), said


# -- group commit: several jobs' batches in one transaction (aibro_backend/storage/groupcommit.py) ---------------------
def test_batches_committed_together_match_the_log_and_a_failing_one_is_rolled_back_alone(
    store: Store, log: Store
) -> None:
    """Three jobs' batches in one transaction, the middle one failing inside it: the other two are stored with
    gap-free seqs and consecutive gids, the failing one leaves nothing behind (log, window, job row), and its
    job's next batch starts at seq 1."""
    alice, bob = store.users.ensure("alice"), store.users.ensure("bob")
    for job, uid in (("job-a", alice), ("job-b", alice), ("job-c", bob)):
        store.jobs.create(job, uid, SPEC)
    bad = [*batch(2, 1), NewEvent("epoch", {"epoch": 0, "logs": {}, "x": {1}}, wseq=3)]  # data that is not JSON
    results = store.events.append_batches(
        [
            EventBatch("job-a", batch(3, 1), 0),
            EventBatch("job-b", bad, 0),
            EventBatch("job-c", [*batch(2, 1), NewEvent("epoch", {"epoch": 0, "logs": {}}, wseq=3)], 0),
        ]
    )
    assert isinstance(results[1], TypeError)
    assert [e["seq"] for e in results[0]] == [1, 2, 3] and [e["seq"] for e in results[2]] == [1, 2, 3]
    gids = [e["gid"] for e in results[0] + results[2]]
    assert gids == list(range(gids[0], gids[0] + 6)), "the batches that commit take consecutive gids"
    assert store.events.parts("job-b", 0) == log.events.parts("job-b", 0) == []
    assert store.jobs.get("job-c").epochs_done == 1 and store.jobs.get("job-b").epochs_done == 0
    for job in ("job-a", "job-c"):
        assert store.events.parts(job, 0) == log.events.parts(job, 0)
    for uid in (alice, bob):
        assert store.events.user_parts(uid, 0) == log.events.user_parts(uid, 0)
    assert [e["seq"] for e in store.events.append_many("job-b", batch(2, 4), attempt=0)] == [1, 2]


def test_a_batch_for_a_deleted_job_is_refused_alone(store: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    results = store.events.append_batches([EventBatch("job-gone", batch(2, 1), 0), EventBatch("job-a", batch(2, 1), 0)])
    assert isinstance(results[0], NoSuchJob) and [e["seq"] for e in results[1]] == [1, 2]


def test_a_workers_status_event_never_moves_a_job_that_ended_while_its_batch_waited(store: Store) -> None:
    """The worker's post is checked against the job, then waits for its group: a cancel that lands in between
    must not be undone by the batch's TRAINING status event (its other events are kept)."""
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, SPEC)
    store.events.append("job-a", "status", {"status": "CANCELED", "substatus": "CANCELED"})
    status = NewEvent("status", {"status": "TRAINING", "substatus": "TRAINING"}, wseq=1, ts=1000.0)
    (stored,) = store.events.append_batches([EventBatch("job-a", [status, *batch(1, 2)], 0, from_worker=True)])
    assert [e["type"] for e in stored] == ["log"]
    assert store.jobs.get("job-a").status == "CANCELED"


def test_batches_posted_in_one_turn_of_the_loop_share_one_commit(store: Store, log: Store) -> None:
    """What the worker route does under load: every batch that reaches the loop in the same turn waits for one
    commit, and each hears its own result (a failing one its exception)."""
    uid = store.users.ensure("u")
    jobs = [f"job-{i}" for i in range(5)]
    for job in jobs:
        store.jobs.create(job, uid, SPEC)
    group = GroupCommit(store)

    async def post_all() -> list[Any]:
        futures = [group.append(job, batch(4, 1), 0) for job in jobs]
        futures.append(group.append("job-gone", batch(1, 1), 0))
        return await asyncio.gather(*futures, return_exceptions=True)

    results = asyncio.run(post_all())
    assert (group.batches, group.commits) == (6, 1)
    assert all([e["seq"] for e in r] == [1, 2, 3, 4] for r in results[:5]) and isinstance(results[5], NoSuchJob)
    assert store.events.user_parts(uid, 0) == log.events.user_parts(uid, 0)
    assert len(store.events.user_parts(uid, 0)[0]) == 20

    async def one_at_a_time() -> None:
        for job in jobs[:2]:
            await group.append(job, batch(1, 5), 0)

    asyncio.run(one_at_a_time())
    assert (group.batches, group.commits) == (8, 3), "a batch alone is committed at once, not held for company"
