"""The kernel's random generators, kept where they were around work that draws from them on the user's behalf."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Whatever random numbers the block draws (rebuilding layers draws default seeds and runs initializers), the
    kernel's own generators are where they were: a seeded notebook draws the same numbers with or without a
    remote fit in between. Python's and NumPy's, Keras' global seed generator and TensorFlow's eager op seeds."""
    import random

    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    py, npy = random.getstate(), np.random.get_state()
    key = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator")
    keras_gen = global_state.get_global_attribute(key)
    keras_state = None if keras_gen is None else np.asarray(keras_gen.state)
    tf_rng = _tf_op_seeds()
    tf_state = tf_rng.getstate() if tf_rng is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        global_state.set_global_attribute(key, keras_gen)
        if keras_gen is not None:
            keras_gen.state.assign(keras_state)
        if tf_rng is not None and tf_state is not None:
            tf_rng.setstate(tf_state)


def _tf_op_seeds() -> Any:
    """TensorFlow's eager context draws each unseeded op's seed from this Random (None where it has none)."""
    try:
        from tensorflow.python.eager import context

        rng = getattr(context.context(), "_rng", None)
    except Exception:  # noqa: BLE001 - another TensorFlow layout: nothing to keep
        return None
    return rng if hasattr(rng, "getstate") else None
