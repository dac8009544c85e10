"""Per-epoch checkpoints written straight from the weights snapshot must be the `.keras` file Keras would save.

The worker's pipeline learns the weights file's layout once and then patches the snapshot's bytes into it
(aibro_backend.worker.checkpointfile). A user downloads these checkpoints (`--ckpt-dir`) and a resumed job starts
from them, so each must load with `keras.saving.load_model` and hold exactly the live model's variables, optimizer
state included, at that epoch, for several kinds of model.
"""

from __future__ import annotations

import json
import shutil
import threading
import zipfile
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from aibro_backend.worker import checkpointfile
from aibro_backend.worker.callbacks import EventCallback
from aibro_backend.worker.checkpointfile import CheckpointFile
from aibro_backend.worker.pipeline import EpochPipeline, shadow_loader

pytestmark = pytest.mark.fast


def dense_adam() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(96, 8)).astype("float32"), rng.integers(0, 3, 96).astype("int32")


def functional_batchnorm_sgd() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    inputs = keras.Input((6,))
    h = keras.layers.Dense(12)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    rng = np.random.default_rng(1)
    return model, rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


def embedding_lstm_rmsprop() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    model = keras.Sequential(
        [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.LSTM(6), keras.layers.Dense(2)]
    )
    model.compile("rmsprop", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(2)
    return model, rng.integers(0, 20, (48, 5)).astype("int32"), rng.integers(0, 2, 48).astype("int32")


MODELS = {
    "dense-adam": dense_adam,
    "functional-batchnorm-sgd": functional_batchnorm_sgd,
    "lstm": embedding_lstm_rmsprop,
}


def snapshot(model: keras.Model) -> list[np.ndarray]:
    return [w.numpy() for w in model.weights] + [w.numpy() for w in model.optimizer.variables]


def assert_holds(path: Path, model: keras.Model) -> None:
    """The file loads and holds exactly `model`'s weights and optimizer variables."""
    loaded = keras.saving.load_model(path)
    got, want = snapshot(loaded), snapshot(model)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(MODELS))
def test_written_checkpoint_is_what_keras_saves(name: str, tmp_path: Path) -> None:
    model, x, y = MODELS[name]()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    model.save(tmp_path / "start.keras")
    copy = keras.saving.load_model(tmp_path / "start.keras")
    copy.optimizer.build(copy.trainable_variables)
    writer = CheckpointFile.learn(copy, tmp_path)
    assert writer is not None, "the layout of this model's weights file was not learned"

    values = snapshot(model)
    assert not writer.write(values, tmp_path / "early.keras"), "nothing is written before a Keras save is adopted"
    for var, val in zip(list(copy.weights) + list(copy.optimizer.variables), values):
        var.assign(val)
    copy.save(tmp_path / "keras.keras")
    assert writer.adopt(tmp_path / "keras.keras", values, tmp_path, check=True)

    for epoch in range(2):  # later epochs: new values land in the file, nothing stale from the layout or before
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        assert writer.write(snapshot(model), tmp_path / f"epoch-{epoch}.keras")
        assert_holds(tmp_path / f"epoch-{epoch}.keras", model)
    resumed = keras.saving.load_model(tmp_path / "epoch-1.keras")
    resumed.fit(x, y, epochs=1, batch_size=16, verbose=0)  # a resumed attempt trains on from it


def test_writer_check_refuses_a_file_that_differs(tmp_path: Path) -> None:
    model, x, y = dense_adam()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    model.save(tmp_path / "start.keras")
    copy = keras.saving.load_model(tmp_path / "start.keras")
    writer = CheckpointFile.learn(copy, tmp_path)
    assert writer is not None
    values = snapshot(model)
    model.save(tmp_path / "reference.keras")
    off = list(values)
    off[0] = off[0] + 1.0  # one variable off: the check must see it
    assert not writer.adopt(tmp_path / "reference.keras", off, tmp_path, check=True)
    assert writer.adopt(tmp_path / "reference.keras", values, tmp_path, check=True)


class Uploads:
    """Keeps each uploaded checkpoint, as the backend would."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.cancel = threading.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def put(self, type_: str, data: dict[str, Any], ts: float | None = None) -> int:
        self.events.append((type_, data))
        return len(self.events)

    def upload(self, path: Path, epoch: int) -> None:
        shutil.copy(path, self.where / f"epoch-{epoch + 1}.keras")


class Recorder(keras.callbacks.Callback):
    """The live model's variables at the end of each epoch, after the pipeline took its snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.at.append(snapshot(self.model))


def test_every_epoch_checkpoint_of_a_fit_holds_that_epoch(tmp_path: Path) -> None:
    """Through the worker's pipeline: the first checkpoint is Keras' save, later ones are written directly, and
    every one loads and holds the model as it was at the end of its epoch."""
    model, x, y = dense_adam()
    model.fit(x[:16], y[:16], epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    kept = tmp_path / "kept"
    kept.mkdir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    uploads = Uploads(kept)
    pipeline = EpochPipeline(
        uploads,  # type: ignore[arg-type]
        model,
        shadow_loader(keras, tmp_path / "model.keras", True),
        uploads.upload,
        scratch,
    )
    recorder = Recorder()
    epochs = 4
    try:
        callbacks = [EventCallback(uploads, pipeline, epochs, len(x)), recorder]  # type: ignore[arg-type]
        model.fit(x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=callbacks)
        pipeline.drain()
        assert pipeline.writes_directly, "later checkpoints should be written straight from the snapshot"
    finally:
        pipeline.close()
    assert [d["epoch"] for t, d in uploads.events if t == "epoch"] == list(range(epochs))
    assert sorted(p.name for p in kept.iterdir()) == [f"epoch-{e + 1}.keras" for e in range(epochs)]
    for epoch in range(epochs):
        loaded = snapshot(keras.saving.load_model(kept / f"epoch-{epoch + 1}.keras"))
        for a, b in zip(loaded, recorder.at[epoch]):
            np.testing.assert_array_equal(a, b)
    assert list(scratch.iterdir()) == [], "the pipeline leaves no checkpoint files behind"


class LowerRate(keras.callbacks.Callback):
    """Lowers the learning rate at the start of one epoch, as ReduceLROnPlateau or a scheduler would."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.at:
            self.model.optimizer.learning_rate = 0.0001


def saved_rate(path: Path) -> float:
    """The learning rate in a checkpoint's config.json, as Keras wrote it."""
    with zipfile.ZipFile(path) as zf:
        config = json.loads(zf.read("config.json"))
    return float(config["compile_config"]["optimizer"]["config"]["learning_rate"])


def test_a_new_learning_rate_reaches_the_checkpoints_config(tmp_path: Path) -> None:
    """The learning rate lives in a variable and in the config: after a callback changes it, the checkpoints say
    the new rate in both, and those of later epochs are still written directly."""
    model, x, y = dense_adam()
    model.fit(x[:16], y[:16], epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    kept, scratch = tmp_path / "kept", tmp_path / "scratch"
    kept.mkdir()
    scratch.mkdir()
    uploads = Uploads(kept)
    loader = shadow_loader(keras, tmp_path / "model.keras", True)
    pipeline = EpochPipeline(uploads, model, loader, uploads.upload, scratch)  # type: ignore[arg-type]
    epochs = 5
    try:
        callbacks = [LowerRate(2), EventCallback(uploads, pipeline, epochs, len(x))]  # type: ignore[arg-type]
        model.fit(x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=callbacks)
        pipeline.drain()
        assert pipeline.writes_directly
    finally:
        pipeline.close()
    for epoch in range(epochs):
        path = kept / f"epoch-{epoch + 1}.keras"
        want = 0.001 if epoch < 2 else 0.0001
        assert saved_rate(path) == pytest.approx(want)
        assert float(keras.saving.load_model(path).optimizer.learning_rate) == pytest.approx(want)


def test_without_the_writer_every_checkpoint_is_keras_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model the writer declines (here: over its memory bound) still gets a correct checkpoint every epoch."""
    monkeypatch.setattr(checkpointfile, "MAX_TEMPLATE_BYTES", 64)
    model, x, y = dense_adam()
    model.fit(x[:16], y[:16], epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    kept, scratch = tmp_path / "kept", tmp_path / "scratch"
    kept.mkdir()
    scratch.mkdir()
    uploads = Uploads(kept)
    loader = shadow_loader(keras, tmp_path / "model.keras", True)
    pipeline = EpochPipeline(uploads, model, loader, uploads.upload, scratch)  # type: ignore[arg-type]
    recorder = Recorder()
    try:
        callbacks = [EventCallback(uploads, pipeline, 3, len(x)), recorder]  # type: ignore[arg-type]
        model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=callbacks)
        pipeline.drain()
        assert not pipeline.writes_directly
    finally:
        pipeline.close()
    for epoch in range(3):
        loaded = snapshot(keras.saving.load_model(kept / f"epoch-{epoch + 1}.keras"))
        for a, b in zip(loaded, recorder.at[epoch]):
            np.testing.assert_array_equal(a, b)
