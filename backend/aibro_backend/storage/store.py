"""SQLite (WAL) persistence: the one database file, opened once, and its repositories (users, tokens, blobs index,
jobs, the event log, instances, studies, artifacts), each the one place that reads and writes its tables.

The backend is the only process that opens this database; everything else reaches it through the REST API.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path

from .artifacts import Artifacts
from .blobindex import BlobIndex
from .events import Events
from .instances import Instances
from .jobs import Jobs
from .schema import migrate
from .sql import transaction
from .studies import Studies
from .tokens import Tokens
from .users import Users
from .walcheckpoint import Checkpointer


class Store:
    """All persistent state of the backend, one SQLite file in WAL mode, one connection shared by the repositories
    (used on the event loop's thread only; every write in `sql.transaction`).

    `checkpoints_every_s` (the backend sets it) moves WAL checkpoints off the request path: SQLite otherwise copies
    the WAL into the database inside whichever commit crosses 1,000 pages, and under a team's load that commit
    held the event loop for up to ~0.1 s every few seconds (every long-poll and /health waited behind it). A thread
    with its own connection checkpoints PASSIVE instead (never blocking a writer or a reader)."""

    def __init__(self, path: Path, checkpoints_every_s: float | None = None) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit returns once the WAL is on disk, so an acknowledged event survives a power cut, not only
        # a crash of this process; batches make it one sync per worker batch (Events.append_batches)
        self.db.execute("PRAGMA synchronous=FULL")
        migrate(self.db)
        self._checkpointer: Checkpointer | None = None
        if checkpoints_every_s:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = Checkpointer(self.path, checkpoints_every_s)
        for suffix in ("", "-wal", "-shm"):  # 0600 whatever the opener's umask (SQLite gives WAL/SHM the db's mode)
            try:
                os.chmod(f"{self.path}{suffix}", 0o600)
            except OSError:
                pass
        self.users = Users(self.db)
        self.tokens = Tokens(self.db)
        self.blobs = BlobIndex(self.db)
        self.jobs = Jobs(self.db)
        self.events = Events(self.db, self._checkpointer)
        self.instances = Instances(self.db)
        self.studies = Studies(self.db)
        self.artifacts = Artifacts(self.db)

    def transaction(self) -> AbstractContextManager[None]:
        """Several repositories' writes in one commit (sql.transaction on this store's connection)."""
        return transaction(self.db)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # leave the database whole, the WAL empty
        self.db.close()
