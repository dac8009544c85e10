"""The worker's event outbox: numbered events, resent until the backend acknowledges them, so a dropped
connection or a backend restart loses and duplicates nothing. Its replies also carry the cancel flag."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from aibro_core import backoff
from aibro_core.errors import ApiError, BackendUnreachable
from aibro_core.transport import Transport

HEARTBEAT_S = 0.5
log = logging.getLogger("aibro.worker")


class Outbox:
    def __init__(self, transport: Transport, job_id: str, attempt: int) -> None:
        self.t = transport
        self.job_id = job_id
        self.attempt = attempt
        self.pending: list[dict[str, Any]] = []
        self.next_wseq = 1
        self.acked = 0
        self.cancel = threading.Event()
        self.stale = threading.Event()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="aibro-outbox", daemon=True)
        self._thread.start()

    def put(self, type_: str, data: dict[str, Any], ts: float | None = None) -> int:
        """Queue an event; `ts` is when it happened (default now). An epoch event is stamped when its checkpoint
        is safe, so its `ts` minus `data["ended"]` is the epoch-end work."""
        with self._cond:
            wseq = self.next_wseq
            self.next_wseq += 1
            self.pending.append({"wseq": wseq, "type": type_, "data": data, "ts": time.time() if ts is None else ts})
            self._cond.notify_all()
            return wseq

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every event put so far is acknowledged (or the job went stale)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self.next_wseq - 1
            self._cond.notify_all()
            while any(e["wseq"] <= target for e in self.pending) and not self.stale.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(0.1, left))
        return not self.stale.is_set()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self.pending and not self._stop:
                    self._cond.wait(HEARTBEAT_S)
                if self._stop and not self.pending:
                    return
                batch = list(self.pending[:500])
            try:  # a backend that is down or failing is waited for, however long (the agent gives up apart)
                reply = backoff.retry(functools.partial(self._post, batch), retry_on=_worth_again)
            except ApiError as exc:
                if exc.status == 409:
                    self.stale.set()
                    self.cancel.set()
                    with self._cond:
                        self._cond.notify_all()
                    return
                self._drop(batch, exc)  # 400
                continue
            if reply.get("cancel"):
                self.cancel.set()
            with self._cond:
                self.acked = max(self.acked, int(reply["acked"]))
                self.pending = [e for e in self.pending if e["wseq"] > self.acked]
                self._cond.notify_all()

    def _post(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        return self.t.json(
            "POST", f"/worker/jobs/{self.job_id}/events", json={"attempt": self.attempt, "events": batch}, timeout=30
        )

    def _drop(self, batch: list[dict[str, Any]], exc: ApiError) -> None:
        """The backend refused an event as malformed (400): sending it again can never succeed, so it is dropped,
        and the rest of the batch goes again. The refusal names the event's wseq; without one (the batch itself
        was refused) the whole batch goes. Either way it is logged, and flush() does not wait for it."""
        wseq = exc.body.get("wseq")
        bad = {wseq} if isinstance(wseq, int) and any(e["wseq"] == wseq for e in batch) else {e["wseq"] for e in batch}
        log.warning("the backend refused worker event(s) %s, dropped: %s", sorted(bad)[:10], exc)
        with self._cond:
            self.pending = [e for e in self.pending if e["wseq"] not in bad]
            self._cond.notify_all()


def _worth_again(exc: BaseException) -> bool:
    """Sending again may succeed: the backend is out of reach or failing, but did not refuse the batch (400: an
    event is malformed; 409: this attempt is no longer the job's)."""
    return isinstance(exc, BackendUnreachable) or (isinstance(exc, ApiError) and exc.status not in (400, 409))
