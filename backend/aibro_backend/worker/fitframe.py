"""`model.fit`'s own state (its epoch iterator above all) freed on a background thread, not on the way out of fit.

When `fit` returns, Python frees its locals, and with them the epoch iterator: tf.data then cancels and joins its
pipeline's threads. On this box that sometimes sleeps 0.4 to 1.1 s (no thread of the worker uses any CPU
meanwhile), in about one fit in four on a warm worker, and every second of it lies between the last epoch and
the trained model going back. `KeepFitFrame` holds on to fit's frame from `on_train_end`, so its locals outlive
the return, and to the validation iterator Keras keeps on the model between epochs (fit deletes it just before
`on_train_end`). `release_in_background` then drops both on a thread of their own while the worker uploads the
model; the worker joins that thread before it settles its heap for the next job, so no job's iterator outlives it.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import keras

from aibro_core.compat import keras as keras_compat


class KeepFitFrame(keras.callbacks.Callback):
    """Keeps the running `fit` frame from `on_train_end` (none when no frame up the stack owns an
    `epoch_iterator`, as in a Keras whose fit is laid out differently: then nothing changes), and the model's
    validation iterator from each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.frame: FrameType | None = None
        self.validation: Any = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        iterator = keras_compat.eval_epoch_iterator(self.model)
        if iterator is not None:
            self.validation = iterator

    def on_train_end(self, logs: dict | None = None) -> None:
        frame = sys._getframe(1)
        while frame is not None and "epoch_iterator" not in frame.f_code.co_varnames:
            frame = frame.f_back
        self.frame = frame

    def release_in_background(self) -> threading.Thread | None:
        """Drop the kept frame, and so fit's locals, on a thread of its own (started, returned to be joined):
        these attributes hold the last references once fit has returned, so the thread frees them."""
        if self.frame is None and self.validation is None:
            return None
        thread = threading.Thread(target=self._drop, name="aibro-release", daemon=True)
        thread.start()
        return thread

    def _drop(self) -> None:
        self.frame = None
        self.validation = None
