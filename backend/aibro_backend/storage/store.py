"""SQLite (WAL) persistence for users, tokens, blobs index, jobs, the event log, instances and artifacts.

The backend is the only process that opens this database; everything else reaches it through the REST API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from aibro_core import vocabulary as v
from aibro_core.files import new_token
from aibro_core.jobpicture import JobPicture

from ..server.jsonout import dumps
from .recent import RecentEvents, encode_event
from .records import ExecutionRecord, InstanceRecord, JobRecord, StudyRecord, TrialRecord

log = logging.getLogger(__name__)
ENROLL_TTL_S = 3600.0  # a one-time enrollment token not used within this is refused (the instance is relaunched)
TOKEN_TOUCH_S = 60.0  # last_used is written at most this often per token, so a polling client costs no writes

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
CREATE TABLE IF NOT EXISTS s3_doomed (key TEXT PRIMARY KEY, after REAL NOT NULL);
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
        db.execute("UPDATE tokens SET id=? WHERE hash=?", (_token_id(), token_hash))


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


# Schema version N is reached by MIGRATIONS[N - 1]; a new change appends a step (never edits one) and the SCHEMA
# above says what a new database holds at the latest version.
MIGRATIONS = (
    _v1_token_ids,
    _v2_instance_enrollment_and_price,
    _v3_blob_use,
    _v4_blob_claims,
    _v5_studies,
    _v6_trial_executions,
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
    db.executescript(SCHEMA)  # tables a database lacks (all of them for a new one); existing ones are left alone
    for version in range(SCHEMA_VERSION + 1 if fresh else was + 1, SCHEMA_VERSION + 1):
        db.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS[version - 1](db)
            db.execute(f"PRAGMA user_version={version}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    if fresh:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    db.executescript(INDEXES)
    return was


def _token_id() -> str:
    """A token's public name: what `aibro token list` shows and `aibro token revoke` takes."""
    return "tok_" + secrets.token_hex(6)


def hash_token(token: str) -> str:
    """Tokens are stored hashed so a copy of the database grants nothing."""
    return hashlib.sha256(token.encode()).hexdigest()


class NewEvent(NamedTuple):
    """An event to append: its type and data, the worker's wseq (deduplicates a resent batch), its timestamp."""

    type: str
    data: dict[str, Any]
    wseq: int | None = None
    ts: float | None = None


class NoSuchJob(KeyError):
    """Events for a job that is not (or no longer) in the store."""


class EventBatch(NamedTuple):
    """One job's events to append together; `from_worker`: its status events never move a job that has ended
    (a worker's post is checked against the job before it waits for the group commit)."""

    job_id: str
    events: list[NewEvent]
    attempt: int | None = None
    from_worker: bool = False


class Store:
    """All persistent state of the backend, one SQLite file in WAL mode.

    `checkpoints_every_s` (the backend sets it) moves WAL checkpoints off the request path: SQLite otherwise copies
    the WAL into the database inside whichever commit crosses 1,000 pages, and under a team's load that commit
    held the event loop for up to ~0.1 s every few seconds (every long-poll and /health waited behind it). A thread
    with its own connection checkpoints PASSIVE instead (never blocking a writer or a reader)."""

    def __init__(self, path: Path, checkpoints_every_s: float | None = None) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.recent = RecentEvents()
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit returns once the WAL is on disk, so an acknowledged event survives a power cut, not only
        # a crash of this process; batches make it one sync per worker batch (append_events)
        self.db.execute("PRAGMA synchronous=FULL")
        migrate(self.db)
        self._checkpointer: _Checkpointer | None = None
        if checkpoints_every_s:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = _Checkpointer(self.path, checkpoints_every_s)
        for suffix in ("", "-wal", "-shm"):  # 0600 whatever the opener's umask (SQLite gives WAL/SHM the db's mode)
            try:
                os.chmod(f"{self.path}{suffix}", 0o600)
            except OSError:
                pass

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Several writes in one commit: a reader (another process, a test) sees all of them or none."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- users and tokens -------------------------------------------------------------------------
    def user_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM users").fetchone()[0])

    def ensure_user(self, name: str) -> int:
        row = self.db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
        if row:
            return int(row["id"])
        cur = self.db.execute("INSERT INTO users (name, created) VALUES (?, ?)", (name, time.time()))
        return int(cur.lastrowid)

    def new_token(self, user_id: int, expires_in_s: float | None = None) -> str:
        return self.mint_token(user_id, expires_in_s)["token"]

    def mint_token(self, user_id: int, expires_in_s: float | None = None) -> dict[str, Any]:
        """A new token for the user: the secret is returned once (only its hash is kept) with its public id."""
        token, now = new_token("u"), time.time()
        expires = None if expires_in_s is None else now + float(expires_in_s)
        tid = _token_id()
        self.db.execute(
            "INSERT INTO tokens (hash, user_id, created, id, expires) VALUES (?, ?, ?, ?, ?)",
            (hash_token(token), user_id, now, tid, expires),
        )
        return {"id": tid, "token": token, "created": now, "expires": expires}

    def user_for_token(self, token: str) -> dict[str, Any] | None:
        found = self.token_lookup(token)
        return {"id": found["user_id"], "name": found["name"]} if found and not found["expired"] else None

    def token_lookup(self, token: str) -> dict[str, Any] | None:
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
            self.db.execute("UPDATE tokens SET last_used=? WHERE hash=?", (now, row["hash"]))
        return {
            "id": row["id"],
            "user_id": int(row["user_id"]),
            "name": row["name"],
            "expires": row["expires"],
            "expired": expired,
        }

    def tokens(self, user_id: int) -> list[dict[str, Any]]:
        """The user's live tokens, oldest first: ids and times, never the secret (nor its hash)."""
        rows = self.db.execute(
            "SELECT id, created, expires, last_used FROM tokens WHERE user_id=? AND (expires IS NULL OR expires>?) "
            "ORDER BY created",
            (user_id, time.time()),
        ).fetchall()
        return [dict(r) for r in rows]

    def live_tokens(self, user_id: int) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM tokens WHERE user_id=? AND (expires IS NULL OR expires>?)", (user_id, time.time())
        ).fetchone()
        return int(row[0])

    def revoke_token(self, user_id: int, token_id: str) -> bool:
        cur = self.db.execute("DELETE FROM tokens WHERE user_id=? AND id=?", (user_id, token_id))
        return cur.rowcount > 0

    def revoke_all_tokens(self, user_id: int) -> int:
        return self.db.execute("DELETE FROM tokens WHERE user_id=?", (user_id,)).rowcount

    def user_name(self, user_id: int) -> str | None:
        row = self.db.execute("SELECT name FROM users WHERE id=?", (user_id,)).fetchone()
        return str(row["name"]) if row else None

    def user_id(self, name: str) -> int | None:
        row = self.db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
        return int(row["id"]) if row else None

    def drop_expired_tokens(self, grace_s: float = 7 * 86400) -> int:
        """Expired tokens are kept a week (so a client still gets "expired", not "unknown"), then deleted."""
        return self.db.execute(
            "DELETE FROM tokens WHERE expires IS NOT NULL AND expires<?", (time.time() - grace_s,)
        ).rowcount

    # -- counters ---------------------------------------------------------------------------------
    def bump(self, user_id: int, name: str, amount: int) -> None:
        self.db.execute(
            "INSERT INTO counters (user_id, name, value) VALUES (?, ?, ?) "
            "ON CONFLICT (user_id, name) DO UPDATE SET value = value + excluded.value",
            (user_id, name, amount),
        )

    def counters(self, user_id: int) -> dict[str, int]:
        rows = self.db.execute("SELECT name, value FROM counters WHERE user_id=?", (user_id,)).fetchall()
        return {r["name"]: int(r["value"]) for r in rows}

    # -- blobs index ------------------------------------------------------------------------------
    def add_blob(self, sha: str, user_id: int, size: int, s3_key: str | None = None) -> None:
        """Index `sha` as the user's: shared bytes, or (`s3_key`) their own upload not yet verified."""
        now = time.time()
        self.db.execute(
            "INSERT OR IGNORE INTO blobs (sha, user_id, size, created, used, s3_key) VALUES (?, ?, ?, ?, ?, ?)",
            (sha, user_id, size, now, now, s3_key),
        )

    def blob_s3_key(self, sha: str, user_id: int) -> str | None:
        """The key of the user's own unverified copy of `sha`, None when they read the shared one (or none)."""
        row = self.db.execute("SELECT s3_key FROM blobs WHERE sha=? AND user_id=?", (sha, user_id)).fetchone()
        return row["s3_key"] if row else None

    def set_blob_s3_key(self, sha: str, user_id: int, key: str | None, was: str | None) -> bool:
        """Move the user's `sha` from key `was` to `key` (None: the shared, verified copy); False when it was not at
        `was` any more (dropped, or moved by another upload meanwhile)."""
        cur = self.db.execute(
            "UPDATE blobs SET s3_key=? WHERE sha=? AND user_id=? AND s3_key IS ?", (key, sha, user_id, was)
        )
        return cur.rowcount > 0

    def blob_claims(self) -> list[tuple[str, int, str]]:
        """Every (sha, user, key) still read from its user's own upload: what `claims.publish` has yet to prove."""
        rows = self.db.execute("SELECT sha, user_id, s3_key FROM blobs WHERE s3_key IS NOT NULL").fetchall()
        return [(r["sha"], int(r["user_id"]), r["s3_key"]) for r in rows]

    def doom_s3_key(self, key: str, after: float) -> None:
        """Delete `key` from the bucket once `after` (a time) has passed."""
        self.db.execute("INSERT OR REPLACE INTO s3_doomed (key, after) VALUES (?, ?)", (key, after))

    def doomed_s3_keys(self, now: float) -> list[str]:
        """Keys due for deletion, none of them read by any blob row (a key in use again is spared)."""
        rows = self.db.execute(
            "SELECT key FROM s3_doomed WHERE after <= ? AND key NOT IN "
            "(SELECT s3_key FROM blobs WHERE s3_key IS NOT NULL)",
            (now,),
        ).fetchall()
        return [r["key"] for r in rows]

    def forget_doomed(self, key: str) -> None:
        self.db.execute("DELETE FROM s3_doomed WHERE key=?", (key,))

    def blob_size(self, sha: str, user_id: int) -> int | None:
        row = self.db.execute("SELECT size FROM blobs WHERE sha=? AND user_id=?", (sha, user_id)).fetchone()
        return int(row["size"]) if row else None

    def touch_blobs(self, user_id: int, shas: list[str]) -> None:
        """The user is using these blobs now (asked for them, submitted a job that reads them)."""
        marks = ",".join("?" * len(shas))
        self.db.execute(f"UPDATE blobs SET used=? WHERE user_id=? AND sha IN ({marks})", (time.time(), user_id, *shas))

    def stored_bytes(self, user_id: int) -> int:
        row = self.db.execute("SELECT COALESCE(SUM(size), 0) AS n FROM blobs WHERE user_id=?", (user_id,)).fetchone()
        return int(row["n"])

    def blobs_by_use(self, user_id: int) -> list[tuple[str, int]]:
        """The user's blobs as (sha, size), the least recently used first."""
        rows = self.db.execute(
            "SELECT sha, size FROM blobs WHERE user_id=? ORDER BY COALESCE(used, created), created", (user_id,)
        ).fetchall()
        return [(r["sha"], int(r["size"])) for r in rows]

    def blob_held(self, sha: str) -> bool:
        """Whether any user holds `sha`."""
        return self.db.execute("SELECT 1 FROM blobs WHERE sha=? LIMIT 1", (sha,)).fetchone() is not None

    def drop_blob(self, sha: str, user_id: int) -> bool:
        """Forget that the user holds `sha`; True when no user holds it any more (its bytes may go)."""
        self.db.execute("DELETE FROM blobs WHERE sha=? AND user_id=?", (sha, user_id))
        return not self.blob_held(sha)

    # -- studies ----------------------------------------------------------------------------------
    def create_study(self, study_id: str, user_id: int, spec: dict[str, Any], description: str) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO studies (id, user_id, status, spec, description, created, updated) VALUES (?,?,?,?,?,?,?)",
            (study_id, user_id, v.STUDY_RUNNING, json.dumps(spec), description, now, now),
        )

    def study(self, study_id: str, user_id: int | None = None) -> StudyRecord | None:
        sql, args = "SELECT * FROM studies WHERE id=?", (study_id,)
        if user_id is not None:
            sql, args = sql + " AND user_id=?", (study_id, user_id)
        row = self.db.execute(sql, args).fetchone()
        return StudyRecord.of(row) if row else None

    def studies(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[StudyRecord]:
        sql, args = "SELECT * FROM studies WHERE 1=1", []
        if user_id is not None:
            sql, args = sql + " AND user_id=?", [*args, user_id]
        if statuses:
            sql, args = sql + f" AND status IN ({','.join('?' * len(statuses))})", [*args, *statuses]
        return [StudyRecord.of(r) for r in self.db.execute(sql + " ORDER BY created", args).fetchall()]

    def update_study(self, study_id: str, **fields: Any) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE studies SET {cols} WHERE id=?", (*fields.values(), study_id))

    def add_trial(self, study_id: str, trial_id: str, slot: str, job_id: str, values: dict[str, Any]) -> None:
        """A trial (again, when the oracle retries it) running as `job_id`, its execution 0."""
        now = time.time()
        with self.transaction():
            self.db.execute(
                "INSERT OR REPLACE INTO study_trials (study_id, trial_id, slot, job_id, status, trial_values, "
                "created, updated) VALUES (?,?,?,?,?,?,?,?)",
                (study_id, trial_id, slot, job_id, v.TRIAL_RUNNING, json.dumps(values), now, now),
            )
            self.db.execute(  # an earlier run's executions stay the trial's jobs (trial_of_jobs), out of this run
                "UPDATE trial_executions SET execution=-1 WHERE study_id=? AND trial_id=?", (study_id, trial_id)
            )
            self._add_execution(study_id, trial_id, 0, job_id, now)

    def add_execution(self, study_id: str, trial_id: str, execution: int, job_id: str) -> None:
        """The trial's next execution runs as `job_id`: the trial's job from now on."""
        now = time.time()
        with self.transaction():
            self._add_execution(study_id, trial_id, execution, job_id, now)
            self.db.execute(
                "UPDATE study_trials SET job_id=?, updated=? WHERE study_id=? AND trial_id=?",
                (job_id, now, study_id, trial_id),
            )

    def _add_execution(self, study_id: str, trial_id: str, execution: int, job_id: str, now: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO trial_executions (job_id, study_id, trial_id, execution, status, created) "
            "VALUES (?,?,?,?,?,?)",
            (job_id, study_id, trial_id, execution, v.TRIAL_RUNNING, now),
        )

    def update_execution(
        self, job_id: str, status: str, metrics: dict[str, float], best_step: int | None, best_epoch: int | None
    ) -> None:
        """How an execution ended: its metrics at its best epoch, that epoch's index in its History (KerasTuner's
        step) and its number in the job (what its checkpoint is named after: they differ from initial_epoch on)."""
        self.db.execute(
            "UPDATE trial_executions SET status=?, metrics=?, best_step=?, best_epoch=? WHERE job_id=?",
            (status, json.dumps(metrics), best_step, best_epoch, job_id),
        )

    def executions(self, study_id: str, every_run: bool = False) -> dict[str, list[ExecutionRecord]]:
        """Trial id → its current run's executions, in order; with `every_run`, also an earlier run's (one the
        oracle retried since: execution -1)."""
        rows = self.db.execute(
            "SELECT * FROM trial_executions WHERE study_id=? AND execution >= ? ORDER BY trial_id, execution, created",
            (study_id, -1 if every_run else 0),
        )
        out: dict[str, list[ExecutionRecord]] = {}
        for row in rows.fetchall():
            out.setdefault(row["trial_id"], []).append(ExecutionRecord.of(row))
        return out

    def trials(self, study_id: str) -> list[TrialRecord]:
        rows = self.db.execute("SELECT * FROM study_trials WHERE study_id=? ORDER BY trial_id", (study_id,))
        return [TrialRecord.of(r) for r in rows.fetchall()]

    def trial_of_jobs(self, user_id: int, job_id: str | None = None) -> dict[str, tuple[str, str]]:
        """job id → (study id, trial id) for the user's trial jobs (or that one job): the study's own table says
        which jobs are its trials, not what a job spec claims."""
        sql = (
            "SELECT e.job_id, e.study_id, e.trial_id FROM trial_executions e JOIN studies s ON s.id=e.study_id "
            "WHERE s.user_id=?"
        )
        args: tuple[Any, ...] = (user_id,)
        if job_id is not None:
            sql, args = sql + " AND e.job_id=?", (user_id, job_id)
        return {r[0]: (r[1], r[2]) for r in self.db.execute(sql, args).fetchall()}

    def update_trial(self, study_id: str, trial_id: str, **fields: Any) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(
            f"UPDATE study_trials SET {cols} WHERE study_id=? AND trial_id=?", (*fields.values(), study_id, trial_id)
        )

    # -- jobs -------------------------------------------------------------------------------------
    def create_job(self, job_id: str, user_id: int, spec: dict[str, Any], replay_of: str | None = None) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO jobs (id, user_id, status, substatus, spec, description, created, updated, replay_of) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                user_id,
                v.QUEUING,
                v.REQUESTING_SERVER,
                json.dumps(spec),
                spec.get("description", ""),
                now,
                now,
                replay_of,
            ),
        )

    def job(self, job_id: str, user_id: int | None = None) -> JobRecord | None:
        if user_id is None:
            row = self.db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        else:
            row = self.db.execute("SELECT * FROM jobs WHERE id=? AND user_id=?", (job_id, user_id)).fetchone()
        return JobRecord.of(row) if row else None

    def job_state(self, job_id: str, user_id: int | None = None) -> tuple[str, str] | None:
        """The job's status and substatus alone (a long-poll asks this at every wake-up), or None when there is
        no such job (for this user, when one is given)."""
        row = self.db.execute(
            "SELECT status, substatus FROM jobs WHERE id=? AND (? IS NULL OR user_id=?)", (job_id, user_id, user_id)
        ).fetchone()
        return (row["status"], row["substatus"]) if row else None

    def jobs(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[JobRecord]:
        sql, args = "SELECT * FROM jobs WHERE 1=1", []
        if user_id is not None:
            sql += " AND user_id=?"
            args.append(user_id)
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(statuses)
        sql += " ORDER BY created"
        return [JobRecord.of(r) for r in self.db.execute(sql, args).fetchall()]

    def update_job(self, job_id: str, **fields: Any) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*fields.values(), job_id))

    # -- events -----------------------------------------------------------------------------------
    def append_event(
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
        stored = self.append_events(job_id, [NewEvent(type_, data, wseq, ts)], attempt=attempt)
        return stored[0] if stored else None

    def append_events(self, job_id: str, events: list[NewEvent], *, attempt: int | None = None) -> list[dict[str, Any]]:
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
        self.db.execute("BEGIN IMMEDIATE")
        done: list[tuple[str, int, int, list[tuple[int, int, bytes]]] | None] = []
        results: list[list[dict[str, Any]] | Exception] = []
        try:
            for batch in batches:
                self.db.execute("SAVEPOINT batch")
                try:
                    published, stored = self._append_in_transaction(batch)
                except Exception as exc:  # noqa: BLE001 - this batch's answer; the others go on
                    self.db.execute("ROLLBACK TO batch")
                    self.db.execute("RELEASE batch")
                    done.append(None)
                    results.append(exc)
                    continue
                self.db.execute("RELEASE batch")
                done.append(published)
                results.append(stored)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        for published in done:
            if published is not None:
                self.recent.add(*published)
        if self._checkpointer is not None and self._checkpointer.rewind_wanted:
            self._rewind_wal()
        return results

    def _append_in_transaction(
        self, batch: EventBatch
    ) -> tuple[tuple[str, int, int, list[tuple[int, int, bytes]]], list[dict[str, Any]]]:
        """One batch inside an open transaction: what the recent windows get, and the events stored."""
        job_id, events, attempt = batch.job_id, batch.events, batch.attempt
        job = self.db.execute("SELECT user_id, status, substatus FROM jobs WHERE id=?", (job_id,)).fetchone()
        if job is None:
            raise NoSuchJob(job_id)
        uid = job["user_id"]
        if batch.from_worker and job["status"] not in v.JOB_ACTIVE:
            events = [ev for ev in events if ev.type != v.EV_STATUS]  # a worker's own events never move an ended job
        seq = seq_before = self.db.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id=?", (job_id,)
        ).fetchone()[0]
        picture, moved = JobPicture(job["status"], job["substatus"]), None  # the job's row, as the reducer has it
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
            if ev.type in (v.EV_STATUS, v.EV_EPOCH) and picture.apply({"type": ev.type, "data": ev.data, "ts": ts}):
                moved = ts
        self.db.executemany(
            "INSERT INTO events (job_id, user_id, seq, type, ts, data, attempt, wseq) VALUES (?,?,?,?,?,?,?,?)",
            [(job_id, uid, s, ev.type, ts, data_json, attempt, ev.wseq) for ev, s, ts, data_json in kept],
        )
        if moved is not None:  # the job's row as the batch leaves it, in the same transaction
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

    def _rewind_wal(self) -> None:
        """A RESTART checkpoint between two batches, from the writer itself (see _Checkpointer): the frames since
        the last PASSIVE round are copied and the next commit writes the WAL from its start."""
        self._checkpointer.rewind_wanted = False
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

    def event_parts(self, job_id: str, after: int = 0, limit: int = 5000) -> list[bytes]:
        """The job's events after seq `after`, encoded as the API answers them: from the recent window when it
        reaches back that far (no query, no encoding: what a long-poll under load needs), else from the log."""
        parts = self.recent.job_events(job_id, after, limit)
        if parts is not None:
            return parts
        return [encode_event(*row) for row in self._logged("job_id", job_id, "seq", after, limit)]

    def user_event_parts(self, user_id: int, after: int = 0, limit: int = 5000) -> tuple[list[bytes], int]:
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

    def typed_events(self, job_id: str, types: tuple[str, ...]) -> list[dict[str, Any]]:
        """Every event of these types (its timeline, its epochs), however long the job's log is."""
        rows = self.db.execute(
            f"SELECT * FROM events WHERE job_id=? AND type IN ({','.join('?' * len(types))}) ORDER BY seq",
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

    # -- instances --------------------------------------------------------------------------------
    def create_instance(
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
        self.db.execute(
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
            self.db.execute("UPDATE instances SET enroll_hash=NULL WHERE id=?", (row["id"],))
            return None, "the enrollment token expired: the instance must be launched again"
        if row["status"] in (v.CLOSING, v.CLOSED):
            self.db.execute("UPDATE instances SET enroll_hash=NULL WHERE id=?", (row["id"],))
            return None, f"instance {row['id']} is {row['status']}"
        token = new_token("w")
        cur = self.db.execute(
            "UPDATE instances SET token_hash=?, enroll_hash=NULL, enroll_expires=NULL, last_seen=? "
            "WHERE id=? AND enroll_hash=?",
            (hash_token(token), time.time(), row["id"], h),
        )
        if cur.rowcount != 1:  # another request used it first
            return None, "unknown or already used enrollment token"
        return self.instance(row["id"]), token

    def instance_for_enroll(self, enroll_token: str) -> InstanceRecord | None:
        """The live instance whose enrollment token this is, unused and unexpired (the token is not burnt)."""
        row = self.db.execute("SELECT * FROM instances WHERE enroll_hash=?", (hash_token(enroll_token),)).fetchone()
        if row is None or (row["enroll_expires"] or 0) <= time.time() or row["status"] in (v.CLOSING, v.CLOSED):
            return None
        return InstanceRecord.of(row)

    def instance(self, instance_id: str, user_id: int | None = None) -> InstanceRecord | None:
        if user_id is None:
            row = self.db.execute("SELECT * FROM instances WHERE id=?", (instance_id,)).fetchone()
        else:
            row = self.db.execute("SELECT * FROM instances WHERE id=? AND user_id=?", (instance_id, user_id)).fetchone()
        return InstanceRecord.of(row) if row else None

    def instance_for_token(self, token: str) -> InstanceRecord | None:
        row = self.db.execute("SELECT * FROM instances WHERE token_hash=?", (hash_token(token),)).fetchone()
        return InstanceRecord.of(row) if row else None

    def instances(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[InstanceRecord]:
        sql, args = "SELECT * FROM instances WHERE 1=1", []
        if user_id is not None:
            sql += " AND user_id=?"
            args.append(user_id)
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(statuses)
        sql += " ORDER BY created"
        return [InstanceRecord.of(r) for r in self.db.execute(sql, args).fetchall()]

    def set_instance_state(self, instance_id: str, status: str, substatus: str = "", **fields: Any) -> None:
        """Move an instance to a new state and timestamp the transition in its history: [status, substatus, ts,
        job_id], the job it holds from then on (what costs.py bills each job for)."""
        inst = self.instance(instance_id)
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
        fields.update(status=status, substatus=substatus, updated=now, history=json.dumps(history))
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE instances SET {cols} WHERE id=?", (*fields.values(), instance_id))

    def update_instance(self, instance_id: str, **fields: Any) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE instances SET {cols} WHERE id=?", (*fields.values(), instance_id))

    # -- artifacts --------------------------------------------------------------------------------
    def add_artifact(self, job_id: str, name: str, size: int, sha: str) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO artifacts (job_id, name, size, sha, created) VALUES (?, ?, ?, ?, ?)",
            (job_id, name, size, sha, time.time()),
        )

    def newest_artifact(self, user_id: int, name: str) -> str | None:
        """The job of `user_id` that most recently stored an artifact `name`, or None."""
        row = self.db.execute(
            "SELECT a.job_id FROM artifacts a JOIN jobs j ON j.id = a.job_id WHERE j.user_id=? AND a.name=? "
            "ORDER BY a.created DESC LIMIT 1",
            (user_id, name),
        ).fetchone()
        return row["job_id"] if row else None

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT name, size, sha, created FROM artifacts WHERE job_id=? ORDER BY name", (job_id,)
        ).fetchall()
        return [dict(r) for r in rows]

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # leave the database whole, the WAL empty
        self.db.close()


class _Checkpointer(threading.Thread):
    """Copies the WAL into the database every `every_s` seconds from a connection of its own (see Store).

    Its connection reads once before the thread starts, so the database, WAL and shared-memory files are open
    before the backend accepts anyone: at the descriptor limit (a flood of connections) a checkpoint still works.
    A failure that lasts is logged when it starts, every `REPEAT_S` while it lasts, and when it ends.

    SQLite rewinds the WAL only in a write that began after a checkpoint copied all of it; a writer that hardly
    pauses (each batch began while the last checkpoint ran) never meets that, and the file would grow for as long
    as the load lasts. Once the WAL holds more than `RESTART_ABOVE` bytes the thread sets `rewind_wanted`, and the
    writer runs one RESTART checkpoint between two batches (Store._rewind_wal): it copies the frames since the last
    round and the next commit starts the WAL over. Asked from this thread instead, RESTART waited on a busy writer
    and could starve for many seconds on a loaded host; the writer pays a few milliseconds per `RESTART_ABOVE`
    bytes instead."""

    REPEAT_S = 300.0
    RESTART_ABOVE = 64 << 20
    rewind_wanted = False

    def __init__(self, path: Path, every_s: float) -> None:
        super().__init__(name="aibro-wal-checkpoint", daemon=True)
        self.path, self.every_s = path, every_s
        self._stopping = threading.Event()
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self.start()

    def run(self) -> None:
        failing_since: float | None = None
        last_logged = 0.0
        try:
            while not self._stopping.wait(self.every_s):
                try:
                    self._checkpoint()
                except sqlite3.Error as exc:  # a busy or full disk: the next round tries again
                    now = time.monotonic()
                    if failing_since is None or now - last_logged >= self.REPEAT_S:
                        log.warning("WAL checkpoint failed: %s (retrying every %.0f s)", exc, self.every_s)
                        failing_since = failing_since or now
                        last_logged = now
                    continue
                if failing_since is not None:
                    log.info("WAL checkpoint works again after %.0f s", time.monotonic() - failing_since)
                    failing_since = None
        finally:
            self._db.close()

    def _checkpoint(self) -> None:
        # fetchall, never fetchone: a statement left unfinished holds a read snapshot, and a WAL with a reader on
        # it is never rewound
        _busy, frames, _copied = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()[0]
        if frames * self._page_size() > self.RESTART_ABOVE:
            self.rewind_wanted = True

    def _page_size(self) -> int:
        return int(self._db.execute("PRAGMA page_size").fetchall()[0][0]) + 24  # a WAL frame: header + page

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)


def _event_row(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "gid": row["gid"],
        "job_id": row["job_id"],
        "seq": row["seq"],
        "type": row["type"],
        "ts": row["ts"],
        "data": json.loads(row["data"]),
    }
