"""The worker's epoch-only TensorBoard callback (backend/aibro_backend/worker/callbacks.py): every epoch's
scalars land in the event files by the time `fit` returns, and a fit that raises leaves no writer thread behind."""

from __future__ import annotations

import threading
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from aibro_backend.worker.callbacks import EpochTensorBoard

pytestmark = pytest.mark.fast


def scalars(folder: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar tag across the event files in `folder`."""
    out: dict[int, float] = {}
    for path in sorted(folder.glob("events.out.tfevents*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == tag:
                    out[event.step] = float(tf.make_ndarray(value.tensor))
    return out


def small_model() -> keras.Model:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(256, 8)).astype("float32"), rng.integers(0, 4, 256)


def writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aibro-tensorboard"]


def test_every_epochs_scalars_are_written_when_fit_returns(tmp_path: Path) -> None:
    x, y = data()
    model = small_model()
    history = model.fit(
        x, y, epochs=4, batch_size=32, validation_split=0.25, verbose=0,
        callbacks=[EpochTensorBoard(log_dir=str(tmp_path), write_graph=False, profile_batch=0)],
    )  # fmt: skip
    train = scalars(tmp_path / "train", "epoch_loss")
    assert sorted(train) == [0, 1, 2, 3]
    assert [train[i] for i in range(4)] == pytest.approx(history.history["loss"], rel=1e-5)
    val = scalars(tmp_path / "validation", "epoch_loss")
    assert [val[i] for i in range(4)] == pytest.approx(history.history["val_loss"], rel=1e-5)
    assert sorted(scalars(tmp_path / "train", "epoch_learning_rate")) == [0, 1, 2, 3]
    assert not writers(), "the writer thread outlived fit"


class Boom(keras.callbacks.Callback):
    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == 1:
            raise RuntimeError("boom")


def test_a_fit_that_raises_leaves_no_writer_after_close(tmp_path: Path) -> None:
    x, y = data()
    board = EpochTensorBoard(log_dir=str(tmp_path), write_graph=False, profile_batch=0)
    with pytest.raises(RuntimeError, match="boom"):
        small_model().fit(x, y, epochs=4, batch_size=32, verbose=0, callbacks=[board, Boom()])
    board.close()  # what the worker does in its finally: on_train_end never came
    assert not writers()
    assert sorted(scalars(tmp_path / "train", "epoch_loss")) == [0, 1]
