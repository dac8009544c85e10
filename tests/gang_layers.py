"""The user's own code in a job of several workers (tests/test_gang_job.py): a keras.ops layer and a closure loss. It
travels to the worker as source, so it imports nothing but Keras."""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="gang")
class Doubled(keras.layers.Layer):
    """Written with keras.ops: it runs on any backend, the gang's JAX too."""

    def call(self, x: Any) -> Any:
        return keras.ops.multiply(x, 2.0)


def scaled_crossentropy(scale: float) -> Any:
    """A closure loss: it travels with the value it closes over."""

    def loss(y_true: Any, y_pred: Any) -> Any:
        return scale * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    return loss
