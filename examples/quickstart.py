"""Quickstart: train a small CNN on scikit-learn's digits on the embedded local backend.

Run: python examples/quickstart.py   (starts the embedded backend on 127.0.0.1 if none runs)
"""

from __future__ import annotations

import os

from aibro_jupyter.quiet import import_tensorflow_quietly

import_tensorflow_quietly()  # TensorFlow's native start-up lines (absl, cuInit) stay off the screen

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from aibro_jupyter import Training  # noqa: E402
from aibro_jupyter.firstrun import embedded_note  # noqa: E402


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    y = data.target.astype("int32")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(x))
    x, y = x[idx], y[idx]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    x_train, y_train, x_val, y_val = digits()
    model = build_model()
    Training.available_machines()
    job_id, model, history = Training.online_fit(
        model,
        x_train,
        y_train,
        machine_ids="local-cpu",
        batch_size=32,
        epochs=int(os.environ.get("QUICKSTART_EPOCHS", "8")),
        validation_data=(x_val, y_val),
        description="quickstart digits cnn",
        cool_down_period_s=120,
    )
    loss, acc = model.evaluate(x_val, y_val, verbose=0)
    print(f"final validation accuracy of {job_id} (evaluated in this process): {acc:.4f}")
    note = embedded_note()
    if note:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
