"""The database's tables, and the numbered migrations that bring an older database to them (PRAGMA user_version).

A new change appends a migration step (never edits one) and changes the SCHEMA a new database is made with."""

from __future__ import annotations

import sqlite3

from .sql import transaction, write
from .tokens import token_id

TRIAL_EXECUTIONS = """CREATE TABLE IF NOT EXISTS trial_executions (job_id TEXT PRIMARY KEY, study_id TEXT NOT NULL,
    trial_id TEXT NOT NULL, execution INTEGER NOT NULL, status TEXT NOT NULL, metrics TEXT NOT NULL DEFAULT '{}',
    best_step INTEGER, best_epoch INTEGER, created REAL NOT NULL)"""
STUDY_TABLES = (
    """CREATE TABLE IF NOT EXISTS studies (id TEXT PRIMARY KEY, user_id INTEGER NOT NULL, status TEXT NOT NULL,
    spec TEXT NOT NULL, description TEXT NOT NULL DEFAULT '', message TEXT, created REAL NOT NULL,
    updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS study_trials (study_id TEXT NOT NULL, trial_id TEXT NOT NULL, slot TEXT NOT NULL,
    job_id TEXT NOT NULL, status TEXT NOT NULL, trial_values TEXT NOT NULL, score REAL, message TEXT,
    metrics TEXT NOT NULL DEFAULT '{}', best_step INTEGER, created REAL NOT NULL, updated REAL NOT NULL,
    hyperparameters TEXT, PRIMARY KEY (study_id, trial_id))""",
    TRIAL_EXECUTIONS,
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (hash TEXT PRIMARY KEY, user_id INTEGER NOT NULL, created REAL NOT NULL,
    id TEXT, expires REAL, last_used REAL);
CREATE TABLE IF NOT EXISTS blobs (sha TEXT NOT NULL, user_id INTEGER NOT NULL, size INTEGER NOT NULL,
    created REAL NOT NULL, used REAL, s3_key TEXT, PRIMARY KEY (sha, user_id));
CREATE TABLE IF NOT EXISTS s3_doomed (key TEXT PRIMARY KEY, after REAL NOT NULL, upload_id TEXT);
CREATE TABLE IF NOT EXISTS counters (user_id INTEGER NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY (user_id, name));
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, user_id INTEGER NOT NULL, status TEXT NOT NULL,
    substatus TEXT NOT NULL, spec TEXT NOT NULL, description TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, updated REAL NOT NULL, machine_id TEXT, instance_id TEXT,
    attempt INTEGER NOT NULL DEFAULT 0, cancel_requested INTEGER NOT NULL DEFAULT 0,
    epochs_done INTEGER NOT NULL DEFAULT 0, replay_of TEXT);
CREATE TABLE IF NOT EXISTS events (gid INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
    user_id INTEGER NOT NULL, seq INTEGER NOT NULL, type TEXT NOT NULL, ts REAL NOT NULL, data TEXT NOT NULL,
    attempt INTEGER, wseq INTEGER, UNIQUE (job_id, seq));
CREATE UNIQUE INDEX IF NOT EXISTS events_worker_seq ON events (job_id, attempt, wseq) WHERE wseq IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_user ON events (user_id, gid);
CREATE TABLE IF NOT EXISTS instances (id TEXT PRIMARY KEY, user_id INTEGER NOT NULL, provider TEXT NOT NULL,
    machine_id TEXT NOT NULL, status TEXT NOT NULL, substatus TEXT NOT NULL DEFAULT '', pid INTEGER,
    token_hash TEXT NOT NULL, job_id TEXT, cool_down_s REAL NOT NULL DEFAULT 0, cooling_until REAL,
    created REAL NOT NULL, updated REAL NOT NULL, last_seen REAL, history TEXT NOT NULL DEFAULT '[]',
    enroll_hash TEXT, enroll_expires REAL, price_per_hour REAL);
CREATE INDEX IF NOT EXISTS instances_token ON instances (token_hash);
CREATE TABLE IF NOT EXISTS artifacts (job_id TEXT NOT NULL, name TEXT NOT NULL, size INTEGER NOT NULL,
    sha TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (job_id, name));
""" + "".join(t + ";\n" for t in STUDY_TABLES)
# Indexes on columns a migration added: made once the database is at the latest version.
INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS tokens_id ON tokens (id);
CREATE INDEX IF NOT EXISTS blobs_user ON blobs (user_id, used);
"""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}


def _add_columns(db: sqlite3.Connection, table: str, columns: tuple[tuple[str, str], ...]) -> None:
    have = _columns(db, table)
    for col, kind in columns:
        if col not in have:  # steps 1-3 predate the version number: an old database may hold some of them
            db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {kind}")


def _v1_token_ids(db: sqlite3.Connection) -> None:
    """Tokens got a public id (what `aibro token list` shows), an optional expiry and their last use."""
    _add_columns(db, "tokens", (("id", "TEXT"), ("expires", "REAL"), ("last_used", "REAL")))
    for (token_hash,) in db.execute("SELECT hash FROM tokens WHERE id IS NULL").fetchall():
        db.execute("UPDATE tokens SET id=? WHERE hash=?", (token_id(), token_hash))


def _v2_instance_enrollment_and_price(db: sqlite3.Connection) -> None:
    """Instances got one-time enrollment (cloud machines) and the $/h they were started at (costs.py)."""
    _add_columns(db, "instances", (("enroll_hash", "TEXT"), ("enroll_expires", "REAL"), ("price_per_hour", "REAL")))


def _v3_blob_use(db: sqlite3.Connection) -> None:
    """Blobs got their last use: the least recently used go first when a user's stored bytes are over quota."""
    _add_columns(db, "blobs", (("used", "REAL"),))


def _v4_blob_claims(db: sqlite3.Connection) -> None:
    """S3 uploads became their user's before they are verified (storage/claims.py): the key a user's unverified
    copy lives at, and the keys to delete once no presigned URL to them can still be in use."""
    _add_columns(db, "blobs", (("s3_key", "TEXT"),))
    db.execute("CREATE TABLE IF NOT EXISTS s3_doomed (key TEXT PRIMARY KEY, after REAL NOT NULL)")


def _v5_studies(db: sqlite3.Connection) -> None:
    """Hyperparameter studies (scheduling/studies.py) and their trials, each run as a job."""
    for table in STUDY_TABLES:
        db.execute(table)


def _v6_trial_executions(db: sqlite3.Connection) -> None:
    """A trial runs KerasTuner's executions_per_trial fits, each its own job (tuning/studies.py), and keeps the
    HyperParameters the oracle ended it with; each earlier trial's one job becomes its execution 0."""
    _add_columns(db, "study_trials", (("hyperparameters", "TEXT"),))
    db.execute(TRIAL_EXECUTIONS)
    db.execute(
        "INSERT OR IGNORE INTO trial_executions (job_id, study_id, trial_id, execution, status, metrics, best_step, "
        "best_epoch, created) SELECT job_id, study_id, trial_id, 0, status, metrics, best_step, best_step, created "
        "FROM study_trials"
    )


def _v7_unfinished_s3_uploads(db: sqlite3.Connection) -> None:
    """An S3 upload is due to go from its start (storage/claims.py): a key that was never finished (its client or
    worker killed, S3 failing past the retries) and the multipart upload it began (its id) go once its presigned
    URLs have expired; a finished one is kept."""
    _add_columns(db, "s3_doomed", (("upload_id", "TEXT"),))


# Schema version N is reached by MIGRATIONS[N - 1]; a new change appends a step (never edits one) and the SCHEMA
# above says what a new database holds at the latest version.
MIGRATIONS = (
    _v1_token_ids,
    _v2_instance_enrollment_and_price,
    _v3_blob_use,
    _v4_blob_claims,
    _v5_studies,
    _v6_trial_executions,
    _v7_unfinished_s3_uploads,
)
SCHEMA_VERSION = len(MIGRATIONS)


class NewerSchema(RuntimeError):
    """The database was written by a newer aibro-backend than this one."""


def migrate(db: sqlite3.Connection) -> int:
    """Create a new database at SCHEMA_VERSION, or bring an older one there step by step, each step in its own
    transaction with the version it reaches (PRAGMA user_version); the version it was at."""
    fresh = db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='users'").fetchone() is None
    was = int(db.execute("PRAGMA user_version").fetchone()[0])
    if was > SCHEMA_VERSION:
        raise NewerSchema(
            f"this database has schema version {was}, newer than this aibro-backend's {SCHEMA_VERSION}: run the "
            "aibro-backend that wrote it, or upgrade this one"
        )
    _run(db, SCHEMA)  # tables a database lacks (all of them for a new one); existing ones are left alone
    for version in range(SCHEMA_VERSION + 1 if fresh else was + 1, SCHEMA_VERSION + 1):
        with transaction(db):
            MIGRATIONS[version - 1](db)
            db.execute(f"PRAGMA user_version={version}")
    if fresh:
        write(db, f"PRAGMA user_version={SCHEMA_VERSION}")
    _run(db, INDEXES)
    return was


def _run(db: sqlite3.Connection, script: str) -> None:
    """The statements of a script (no `;` inside a statement) in one transaction."""
    with transaction(db):
        for statement in script.split(";"):
            if statement.strip():
                db.execute(statement)
