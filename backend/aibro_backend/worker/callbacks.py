"""The Keras callback that turns training into events, checkpoints and cancel checks."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import keras

from aibro_core import vocabulary as v
from aibro_core.compat import keras as keras_compat

from .outbox import Outbox
from .pipeline import EpochPipeline

BATCH_EVENT_INTERVAL_S = 0.25
# The TensorBoard writer waits this long after an epoch ends: a write at the epoch boundary takes the GIL while the
# training thread runs its own Python there (callbacks, the next epoch's iterator), mid-epoch it mostly waits on
# TensorFlow ops with the GIL released. In-process, the worker's callbacks held the training thread 2.9 ms between
# epochs with the delay and 3.9 ms without it (a plain fit: 0.6 ms; TensorBoard alone: 0.9 and 2.3 ms).
TENSORBOARD_WRITE_DELAY_S = 0.05


def clean_logs(logs: dict[str, Any] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k, val in (logs or {}).items():
        try:
            f = float(val)
        except (TypeError, ValueError):
            continue
        out[k] = f if math.isfinite(f) else None
    return out


class LimitCheck(keras.callbacks.Callback):
    """Ends the fit at the first batch after the job went over a limit that is sampled off the training thread."""

    def __init__(self, check: Callable[[], None]) -> None:
        super().__init__()
        self.check = check

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.check()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.check()


class Interrupted(Exception):
    """Raised out of `fit` when a spot interruption stopped an epoch part-way: its validation is skipped."""


class EventCallback(keras.callbacks.Callback):
    """Per-epoch events with all Keras logs, throttled batch events, a checkpoint every epoch, and a stop
    at the next batch boundary when the job is canceled or the machine is about to be reclaimed (`interrupt`).

    An interruption never leaves half an epoch in the history: an epoch stopped part-way gets no checkpoint and
    no epoch event (its validation is skipped by raising `Interrupted`), so the resumed attempt runs it again from
    the last epoch checkpoint and every epoch appears once. An epoch whose batches all ran before the notice
    arrived is checkpointed and reported as usual, then training stops.

    Its batch hook only reads a flag and, a few times a second, queues an event, so Keras may run it off the
    training thread (`async_safe`); epoch-end work goes to the pipeline's background thread.
    """

    async_safe = True

    def __init__(
        self,
        outbox: Outbox,
        pipeline: EpochPipeline,
        epochs: int,
        samples: int | None,
        interrupt: threading.Event | None = None,
        at_epoch_end: Callable[[], None] | None = None,
    ) -> None:
        """`at_epoch_end` runs after every other callback's epoch end and before the epoch is reported (the
        files the user's callbacks wrote go back then, so the epoch line comes after them)."""
        super().__init__()
        self.at_epoch_end = at_epoch_end
        self.interrupt = interrupt or threading.Event()
        self.cut_short: int | None = None  # the epoch an interruption stopped part-way
        self.resume_at: int | None = None  # where the job must resume after an interruption stopped it early
        self.outbox = outbox
        self.pipeline = pipeline
        self.epochs = epochs
        self.samples = samples
        self._last_batch = 0.0
        self._epoch_start = 0.0
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epochs = int((self.params or {}).get("epochs") or self.epochs)  # what fit was given (a HyperModel's own)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._epoch_start = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.outbox.cancel.is_set():
            self.model.stop_training = True
            return
        if self.interrupt.is_set():
            steps = (self.params or {}).get("steps")
            if steps is None or batch + 1 < steps:
                self.cut_short = self.resume_at = self._epoch
            self.model.stop_training = True
            return
        now = time.monotonic()
        if now - self._last_batch >= BATCH_EVENT_INTERVAL_S:
            self._last_batch = now
            steps = (self.params or {}).get("steps")
            self.pipeline.event(
                v.EV_BATCH, {"epoch": self._epoch, "batch": batch, "steps": steps, "logs": clean_logs(logs)}
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        seconds = time.monotonic() - self._epoch_start
        ended = time.time()
        if self.outbox.cancel.is_set() or self.cut_short == epoch:
            self.model.stop_training = True
            return
        data = {
            "epoch": epoch,
            "epochs": self.epochs,
            "logs": clean_logs(logs),
            "seconds": round(seconds, 4),
            "samples_per_s": round(self.samples / seconds, 2) if self.samples and seconds > 0 else None,
            "ended": ended,
        }
        if self.at_epoch_end is not None:
            self.at_epoch_end()
        self.pipeline.epoch_end(epoch, data)
        if self.interrupt.is_set() and epoch + 1 < self.epochs:
            self.resume_at = epoch + 1
            self.model.stop_training = True

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self.cut_short is not None:
            raise Interrupted(f"epoch {self.cut_short} was stopped part-way by a spot interruption")


class EpochTensorBoard(keras.callbacks.TensorBoard):
    """TensorBoard logs per epoch only: Keras' callback does summary work on every batch even with
    update_freq="epoch", which costs a remote fit several percent against a plain local one.

    The epoch's scalars are written off the training thread: it only reads the learning rate and queues the logs
    for one writer thread per fit (the first write alone creates the event file and traces the summary ops, over
    100 ms, and every later one takes about a millisecond of eager ops), which writes them a moment into the next
    epoch (TENSORBOARD_WRITE_DELAY_S). A queue, not a thread per epoch: starting a thread at every epoch end cost
    the training thread a GIL hand-over each time. `on_train_end` waits for the writes (without the delay) and
    closes the files, so they are complete when fit returns; a fit that ends in an exception never calls
    `on_train_end`, so whoever ran it calls `close()` and no thread is left holding the model. Histograms and
    embeddings read the live weights, so they stay on the training thread."""

    async_safe = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self.close()  # a previous fit's writer, if that fit ended in an exception
        self._write_error: BaseException | None = None
        self._closing = threading.Event()
        self._writes: queue.SimpleQueue[tuple[int, dict[str, Any], float] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = threading.Thread(
            target=self._write_loop, args=(self._writes,), name="aibro-tensorboard", daemon=True
        )
        self._writer.start()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if getattr(self, "_writer", None) is None:
            return  # a loop of the job's own (a HyperModel's fit) calls on_epoch_end alone: nothing to write with
        if logs:
            logs = dict(logs)
            if getattr(self.model, "optimizer", None) is not None:
                logs = keras_compat.tensorboard_with_learning_rate(self, logs)
            train_logs = {k: val for k, val in logs.items() if not k.startswith("val_")}
            if self.write_steps_per_second:
                train_logs["steps_per_second"] = keras_compat.tensorboard_steps_per_second(self)
            val_logs = {k: val for k, val in logs.items() if k.startswith("val_")}
            self._writes.put((epoch, {**train_logs, **val_logs}, time.monotonic()))
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            keras_compat.tensorboard_log_weights(self, epoch)
        if self.embeddings_freq and epoch % self.embeddings_freq == 0:
            keras_compat.tensorboard_log_embeddings(self, epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.close()
        super().on_train_end(logs)
        if self._write_error is not None:
            raise RuntimeError(f"writing TensorBoard logs failed: {self._write_error}") from self._write_error

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (idempotent)."""
        writer: threading.Thread | None = getattr(self, "_writer", None)
        if writer is not None:
            self._closing.set()
            self._writes.put(None)
            writer.join()
            self._writer = None

    def _write_loop(self, writes: queue.SimpleQueue[tuple[int, dict[str, Any], float] | None]) -> None:
        while (item := writes.get()) is not None:
            epoch, logs, queued = item
            if writes.empty():  # nothing behind it: out of the epoch boundary's way, unless close() is waiting
                self._closing.wait(max(0.0, queued + TENSORBOARD_WRITE_DELAY_S - time.monotonic()))
            if self._write_error is None:
                try:
                    self._write_epoch(epoch, logs)
                except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the end of fit
                    self._write_error = exc

    def _write_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """Keras' `_log_epoch_metrics`, with the learning rate already read on the training thread."""
        train_logs = {k: val for k, val in logs.items() if not k.startswith("val_")}
        val_logs = {k[4:]: val for k, val in logs.items() if k.startswith("val_")}
        for validation, part in ((False, train_logs), (True, val_logs)):
            if part:  # the writer (and its directory) only when there is something to write, as Keras does
                with keras_compat.tensorboard_writer(self, validation).as_default():
                    for name, value in part.items():
                        self.summary.scalar(f"epoch_{name}", value, step=epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        return None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        return None

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        return None

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        return None
