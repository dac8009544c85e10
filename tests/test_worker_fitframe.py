"""fit's epoch iterator is freed on a background thread after fit returns, not on the training thread."""

from __future__ import annotations

import threading
import weakref

import keras
import numpy as np
import pytest

from aibro_backend.worker.fitframe import KeepFitFrame

from conftest import make_model

pytestmark = pytest.mark.fast


def digits_like(n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 64)).astype("float32")
    return x, (x[:, :10].argmax(axis=1)).astype("int32")


def test_the_epoch_iterator_outlives_fit_and_is_freed_on_the_release_thread() -> None:
    x, y = digits_like()
    keep = KeepFitFrame()
    make_model().fit(x, y, epochs=2, batch_size=32, verbose=0, callbacks=[keep])
    assert keep.frame is not None, "on_train_end found fit's frame"
    freed: list[str] = []
    weakref.finalize(keep.frame.f_locals["epoch_iterator"], lambda: freed.append(threading.current_thread().name))
    assert freed == [], "fit's locals are still held after it returned"
    thread = keep.release_in_background()
    assert thread is not None
    thread.join(timeout=60)
    assert freed == ["aibro-release"], freed
    assert keep.frame is None


def test_the_validation_iterator_is_freed_on_the_release_thread_too() -> None:
    x, y = digits_like()
    keep = KeepFitFrame()
    freed: list[str] = []

    class Watch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if epoch == 0:  # Keras keeps one validation iterator on the model for the whole fit
                weakref.finalize(self.model._eval_epoch_iterator, lambda: freed.append(threading.current_thread().name))

    make_model().fit(x, y, validation_data=(x[:64], y[:64]), epochs=2, verbose=0, callbacks=[Watch(), keep])
    assert freed == [], "fit deleted the model's validation iterator, but it is still held"
    thread = keep.release_in_background()
    assert thread is not None
    thread.join(timeout=60)
    assert freed == ["aibro-release"], freed


def test_a_fit_that_raises_leaves_nothing_to_release() -> None:
    class Boom(Exception):
        pass

    class Raise(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            raise Boom

    x, y = digits_like()
    keep = KeepFitFrame()
    with pytest.raises(Boom):
        make_model().fit(x, y, epochs=2, batch_size=32, verbose=0, callbacks=[keep, Raise()])
    assert keep.release_in_background() is None
