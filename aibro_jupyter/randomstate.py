"""The kernel's random generators, kept where they were around work that draws from them on the user's behalf."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from aibro_core.compat import keras as keras_compat
from aibro_core.compat import tensorflow as tf_compat


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Whatever random numbers the block draws (rebuilding layers draws default seeds and runs initializers), the
    kernel's own generators are where they were: a seeded notebook draws the same numbers with or without a
    remote fit in between. Python's and NumPy's, Keras' global seed generator and TensorFlow's eager op seeds."""
    import random

    py, npy = random.getstate(), np.random.get_state()
    key, keras_gen = keras_compat.global_seed_generator()
    keras_state = None if keras_gen is None else np.asarray(keras_gen.state)
    tf_rng = tf_compat.eager_op_seeds()
    tf_state = tf_rng.getstate() if tf_rng is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        keras_compat.set_global_seed_generator(key, keras_gen)
        if keras_gen is not None:
            keras_gen.state.assign(keras_state)
        if tf_rng is not None and tf_state is not None:
            tf_rng.setstate(tf_state)
