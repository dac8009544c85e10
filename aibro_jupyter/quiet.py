"""Keep TensorFlow's native start-up chatter (absl's I0000/W0000/E0000 lines such as "failed call to cuInit:
UNKNOWN ERROR (303)" on a machine without a GPU) off the user's screen.

TensorFlow 2.21 writes those lines from C++ straight to file descriptor 2 and ignores TF_CPP_MIN_LOG_LEVEL for
them, so they are silenced at the OS level: fd 2 points at /dev/null while TensorFlow is imported and its devices
are listed (which is when all of them are written). Python's own sys.stderr is untouched before and after, so
warnings and tracebacks still show. AIBRO_NATIVE_LOGS=1 keeps the native lines for debugging."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from .settings import KernelSettings

# A model saved before its first fit has an unbuilt optimizer (just `iterations` and `learning_rate`): loading it
# "skips" optimizer state that was never there.
UNBUILT_OPTIMIZER = (
    r"Skipping variable loading for optimizer '[^']*', because it has \d+ variables whereas the saved optimizer has 2 "
    r"variables"
)


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Point fd 2 at /dev/null for the block (native libraries' direct writes), then restore it."""
    if KernelSettings.from_env().native_logs:
        yield
        return
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def import_tensorflow_quietly() -> ModuleType | None:
    """Import TensorFlow (when installed) and initialize its devices without its native start-up lines; later
    `import keras` / `import tensorflow` then print nothing. None when TensorFlow is not installed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with native_stderr_silenced():
        try:
            import tensorflow as tf
        except ImportError:
            return None
        tf.config.list_physical_devices()
    return tf


@contextmanager
def unbuilt_optimizer_ok() -> Iterator[None]:
    """Loading a model that was saved before any fit: no warning about optimizer variables it never had."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNBUILT_OPTIMIZER)
        yield
