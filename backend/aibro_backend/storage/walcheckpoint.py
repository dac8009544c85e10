"""WAL checkpoints off the request path: a thread with a connection of its own (see Checkpointer)."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class Checkpointer(threading.Thread):
    """Copies the WAL into the database every `every_s` seconds from a connection of its own (see the Store).

    Its connection reads once before the thread starts, so the database, WAL and shared-memory files are open
    before the backend accepts anyone: at the descriptor limit (a flood of connections) a checkpoint still works.
    A failure that lasts is logged when it starts, every `REPEAT_S` while it lasts, and when it ends.

    SQLite rewinds the WAL only in a write that began after a checkpoint copied all of it; a writer that hardly
    pauses (each batch began while the last checkpoint ran) never meets that, and the file would grow for as long
    as the load lasts. Once the WAL holds more than `RESTART_ABOVE` bytes the thread sets `rewind_wanted`, and the
    writer runs one RESTART checkpoint between two batches (Events._rewind_wal): it copies the frames since the last
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
