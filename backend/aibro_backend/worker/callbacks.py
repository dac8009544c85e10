"""The Keras callback that turns training into events, checkpoints and cancel checks."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import keras

from aibro_core import vocabulary as v

from .outbox import Outbox
from .pipeline import EpochPipeline

BATCH_EVENT_INTERVAL_S = 0.25


def clean_logs(logs: dict[str, Any] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k, val in (logs or {}).items():
        try:
            f = float(val)
        except (TypeError, ValueError):
            continue
        out[k] = f if math.isfinite(f) else None
    return out


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
    ) -> None:
        super().__init__()
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

    The epoch's scalars are written off the training thread: it only reads the learning rate and hands the logs
    over (the first write alone creates the event file and traces the summary ops, over 100 ms, and
    every later one takes milliseconds of eager ops). `on_train_end` waits for the writes and closes the files,
    so they are complete when fit returns. Histograms and embeddings read the live weights, so they stay on the
    training thread."""

    async_safe = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self._last_write: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs:
            logs = dict(logs)
            train_logs = self._collect_learning_rate({k: val for k, val in logs.items() if not k.startswith("val_")})
            if self.write_steps_per_second:
                train_logs["steps_per_second"] = self._compute_steps_per_second()
            val_logs = {k: val for k, val in logs.items() if k.startswith("val_")}
            # One short thread per epoch, each waiting for the one before (epochs stay in order): nothing is left
            # behind holding the model when fit ends in an exception and on_train_end never comes.
            self._last_write = threading.Thread(
                target=self._write_after,
                args=(self._last_write, epoch, {**train_logs, **val_logs}),
                name="aibro-tensorboard",
                daemon=True,
            )
            self._last_write.start()
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._log_weights(epoch)
        if self.embeddings_freq and epoch % self.embeddings_freq == 0:
            self._log_embeddings(epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._last_write is not None:
            self._last_write.join()
            self._last_write = None
        super().on_train_end(logs)
        if self._write_error is not None:
            raise RuntimeError(f"writing TensorBoard logs failed: {self._write_error}") from self._write_error

    def _write_after(self, previous: threading.Thread | None, epoch: int, logs: dict[str, Any]) -> None:
        if previous is not None:
            previous.join()
        if self._write_error is None:
            try:
                self._write_epoch(epoch, logs)
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the end of fit
                self._write_error = exc

    def _write_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """Keras' `_log_epoch_metrics`, with the learning rate already read on the training thread."""
        train_logs = {k: val for k, val in logs.items() if not k.startswith("val_")}
        val_logs = {k[4:]: val for k, val in logs.items() if k.startswith("val_")}
        for writer, part in (("_train_writer", train_logs), ("_val_writer", val_logs)):
            if part:  # the writer (and its directory) only when there is something to write, as Keras does
                with getattr(self, writer).as_default():
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
