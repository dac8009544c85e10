"""The store's schema has a version and numbered migrations (issue 25 item 4): a database written by the first
release's schema (tests/fixtures/schema_foundation.sql, as store.py created it at the foundation commit) opens
with its rows intact at the latest version, a new one starts there, and one from a newer backend is refused."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from aibro_backend.storage.schema import SCHEMA_VERSION, NewerSchema
from aibro_backend.storage.store import Store
from aibro_backend.storage.tokens import hash_token

pytestmark = pytest.mark.fast
OLD = Path(__file__).parent / "fixtures" / "schema_foundation.sql"


def _old_database(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(OLD.read_text())
    now = time.time()
    db.execute("INSERT INTO users (id, name, created) VALUES (1, 'alice', ?)", (now,))
    db.execute("INSERT INTO tokens (hash, user_id, created) VALUES (?, 1, ?)", (hash_token("tok-alice"), now))
    db.execute("INSERT INTO blobs (sha, user_id, size, created) VALUES (?, 1, 42, ?)", ("a" * 64, now))
    db.execute(
        "INSERT INTO jobs (id, user_id, status, substatus, spec, created, updated, epochs_done) "
        "VALUES ('job-1', 1, 'COMPLETED', 'COMPLETED', '{}', ?, ?, 3)",
        (now, now),
    )
    db.execute(
        "INSERT INTO instances (id, user_id, provider, machine_id, status, token_hash, created, updated) "
        "VALUES ('inst-1', 1, 'local', 'local-cpu', 'CLOSED', 'x', ?, ?)",
        (now, now),
    )
    db.commit()
    db.close()


def test_a_first_release_database_is_upgraded_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "aibro.db"
    _old_database(path)
    store = Store(path)
    try:
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.tokens.user_for("tok-alice")["name"] == "alice", "an old token still signs in"
        assert [t["id"].startswith("tok_") for t in store.tokens.list(1)] == [True], "old tokens got a public id"
        assert store.jobs.get("job-1").epochs_done == 3
        assert store.instances.get("inst-1").price_per_hour is None
        assert store.blobs.stored_bytes(1) == 42 and store.blobs.by_use(1) == [("a" * 64, 42)]
    finally:
        store.close()
    Store(path).close()  # opening again changes nothing


def test_a_new_database_starts_at_the_latest_version(tmp_path: Path) -> None:
    store = Store(tmp_path / "aibro.db")
    try:
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        indexes = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {"tokens_id", "blobs_user", "instances_token"} <= indexes
    finally:
        store.close()


def test_a_database_from_a_newer_backend_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "aibro.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(NewerSchema, match="newer than this aibro-backend"):
        Store(path)
