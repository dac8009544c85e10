"""What the soak's jobs are made of (benchmarks/soak.py): a small learnable model, synthetic data, a layer that fills
its job's folder past the disk limit, and a KerasTuner build function. A module of its own so that it travels to the
worker as source, as a notebook's helper module would; it imports nothing of aibro's."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic but learnable: ten classes, a linear rule of 64 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64)).astype("float32")
    w = np.random.default_rng(0).normal(size=(64, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def model(seed: int, extra: list[keras.layers.Layer] | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    net = keras.Sequential(
        [
            keras.Input((64,)),
            *(extra or []),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net


@keras.saving.register_keras_serializable(package="soak")
class DiskFill(keras.layers.Layer):
    """Passes its input through; built on a worker, it writes `mb` files of 1 MB into the job's folder, so the
    folder crosses the job's disk limit (AIBRO_JOB_MAX_DISK_BYTES) by the first epoch's end."""

    def __init__(self, mb: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mb = mb
        if not os.environ.get("AIBRO_WORKER_DIR"):
            return
        for i in range(mb):
            with open(f"fill-{i}.bin", "wb") as f:
                f.write(b"x" * (1 << 20))

    def call(self, x: Any) -> Any:
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "mb": self.mb}


def build_model(hp: Any) -> keras.Model:
    """A study's trial: the hidden width is the one hyperparameter."""
    net = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hp.Int("units", 8, 32, step=8), activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return net
