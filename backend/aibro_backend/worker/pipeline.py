"""Epoch-end work off the training thread: checkpoint save + upload, then the epoch event, in order.

The training thread only copies the weights (milliseconds) and goes on with the next epoch. A background
thread writes them into a second copy of the model, saves it as a `.keras` checkpoint, uploads it, and only
then queues the epoch event, so an epoch in the event log always has its checkpoint to resume from. Every
event from the training callback passes through the same queue, so the log keeps training order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .outbox import Outbox

log = logging.getLogger("aibro.worker")
MAX_PENDING_CHECKPOINTS = 2


class EpochPipeline:
    def __init__(
        self,
        outbox: Outbox,
        model: Any,
        load_shadow: Callable[[], Any] | None,
        upload_checkpoint: Callable[[Any, int], None],
    ) -> None:
        """`load_shadow` builds a second copy of the model (None: save the live model on the training thread);
        `upload_checkpoint(model, epoch)` saves and uploads one checkpoint."""
        self.outbox = outbox
        self.model = model
        self.upload_checkpoint = upload_checkpoint
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._slots = threading.Semaphore(MAX_PENDING_CHECKPOINTS)
        self._error: BaseException | None = None
        self._shadow: Any = None
        self._shadow_ready = threading.Event()
        self._checked: bool | None = None
        self._load_shadow = load_shadow
        self._thread = threading.Thread(target=self._run, name="aibro-epoch-pipeline", daemon=True)
        self._thread.start()

    # -- called from the training thread -----------------------------------------------------------
    def event(self, type_: str, data: dict[str, Any]) -> None:
        """Queue an event stamped now: it may wait behind a checkpoint upload, and its time is when it happened."""
        self._raise_if_failed()
        self._queue.put(("event", (type_, data, time.time())))

    def epoch_end(self, epoch: int, data: dict[str, Any]) -> None:
        """Checkpoint `epoch`, then emit its event; blocks only when checkpoints pile up faster than they upload."""
        self._raise_if_failed()
        if self._load_shadow is not None and self._checked is None:
            self._shadow_ready.wait(timeout=600)
            self._checked = self._shadow is not None and self._compatible(self._shadow)
        if not self._checked:
            self.upload_checkpoint(self.model, epoch)
            self._queue.put(("event", ("epoch", data, None)))
            return
        self._slots.acquire()
        snapshot = (
            [w.numpy() for w in self.model.weights],
            [w.numpy() for w in self.model.optimizer.variables],
        )
        self._queue.put(("checkpoint", (epoch, snapshot, data)))

    def drain(self) -> None:
        """Wait until every checkpoint is uploaded and every event is in the outbox."""
        done = threading.Event()
        self._queue.put(("mark", done))
        while not done.wait(0.5):
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join(timeout=60)

    # -- the background thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if self._load_shadow is not None:
            try:
                self._shadow = self._load_shadow()
            except Exception:  # noqa: BLE001 - fall back to saving the live model
                log.exception("could not build the checkpoint copy; checkpoints are saved on the training thread")
            self._shadow_ready.set()
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "mark":
                item.set()
                continue
            if self._error is not None:
                if kind == "checkpoint":
                    self._slots.release()
                continue
            try:
                if kind == "event":
                    self.outbox.put(*item)
                else:
                    epoch, (weights, opt_vars), data = item
                    try:
                        self._write(weights, opt_vars)
                        self.upload_checkpoint(self._shadow, epoch)
                    finally:
                        self._slots.release()
                    self.outbox.put("epoch", data)
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread
                self._error = exc

    def _compatible(self, shadow: Any) -> bool:
        """The copy must hold exactly the live model's variables, optimizer state included."""
        opt = shadow.optimizer
        if opt is None or self.model.optimizer is None:
            return False
        if not opt.built:
            opt.build(shadow.trainable_variables)
        mine = shadow.weights + opt.variables
        live = self.model.weights + self.model.optimizer.variables
        return len(mine) == len(live) and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(mine, live))

    def _write(self, weights: list[Any], opt_vars: list[Any]) -> None:
        for var, val in zip(self._shadow.weights, weights):
            var.assign(val)
        for var, val in zip(self._shadow.optimizer.variables, opt_vars):
            var.assign(val)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"saving a checkpoint failed: {self._error}") from self._error


def shadow_loader(keras: Any, path: Path, safe_mode: bool) -> Callable[[], Any]:
    """A loader for the checkpoint copy: the same file the live model came from."""
    return lambda: keras.saving.load_model(path, safe_mode=safe_mode)
