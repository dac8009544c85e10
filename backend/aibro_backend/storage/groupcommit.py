"""Group commit for worker event batches: the batches that reach the event loop in the same turn share one
transaction and one fsync.

Every acknowledged batch is durable (the WAL synced, `synchronous=FULL`) before its worker hears back, as with
a commit per batch; what changes is how many syncs that takes under load. With many workers posting, several
batches are read in one turn of the loop; each used to pay its own BEGIN, COMMIT and sync (about half of a
batch's time on the loop), now they pay one between them. With one worker posting, a group is one batch and
nothing changes but a turn of the loop before the answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .events import EventBatch, NewEvent
from .store import Store

log = logging.getLogger("aibro.backend")


class GroupCommit:
    """Collects worker batches during one turn of the event loop and appends them together at its end."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[tuple[EventBatch, asyncio.Future[list[dict[str, Any]]]]] = []
        self.batches = 0  # batches appended, and the commits they took: batches / commits is the group size
        self.commits = 0

    def append(self, job_id: str, events: list[NewEvent], attempt: int | None) -> asyncio.Future[list[dict[str, Any]]]:
        """The events stored, once the group holding this batch is committed (raises what its append raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((EventBatch(job_id, events, attempt, from_worker=True), future))
        return future

    def _flush(self) -> None:
        group, self._pending = self._pending, []
        if not group:
            return
        try:
            results: list[Any] = self.store.events.append_batches([batch for batch, _ in group])
        except Exception as exc:  # noqa: BLE001 - the commit failed: every batch of the group hears it
            results = [exc] * len(group)
        else:
            self.batches += len(group)
            self.commits += 1
        for (_, future), result in zip(group, results):
            if future.done():  # its request went away meanwhile; the events are stored all the same
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def summary(self) -> str:
        """One line for the log at shutdown: how much grouping there was."""
        per = self.batches / self.commits if self.commits else 0.0
        return f"worker event batches: {self.batches} in {self.commits} commits ({per:.2f} per commit)"
