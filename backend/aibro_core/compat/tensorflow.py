"""TensorFlow internals (checked with TensorFlow 2.21.0; see tests/test_compat.py and tests/try_newest.py)."""

from __future__ import annotations

from typing import Any


def eager_op_seeds() -> Any:
    """The `random.Random` TensorFlow's eager context draws each unseeded op's seed from (`context.context()._rng`
    in `tensorflow.python.eager`), or None where a TensorFlow has none: no public API saves or restores it."""
    try:
        from tensorflow.python.eager import context

        rng = getattr(context.context(), "_rng", None)
    except Exception:  # noqa: BLE001 - another TensorFlow layout: nothing to keep
        return None
    return rng if hasattr(rng, "getstate") else None


def dataset_input(ds: Any) -> Any:
    """The dataset a unary `tf.data` stage (`.prefetch`, `.repeat`, `.with_options`) was made from
    (`UnaryDataset._input_dataset`): a pipeline's stages have no public accessor."""
    return ds._input_dataset


def stage_kind(ds: Any) -> str:
    """A `tf.data` stage's kind by its class, "RepeatDataset", "PrefetchDataset", "OptionsDataset"...: not public,
    and TensorFlow 2.21 names some with a leading underscore (`_RepeatDataset`), older ones without."""
    return type(ds).__name__.lstrip("_")


def repeat_count(ds: Any) -> int:
    """How many times a `.repeat(count)` stage repeats (-1: forever), from `RepeatDataset._count`; not public."""
    return int(ds._count)


def dataset_inputs(ds: Any) -> list[Any]:
    """The datasets a `tf.data` stage reads (`DatasetV2._inputs()`): a pipeline's graph has no public walk. Raises
    for a kind of dataset without it."""
    return list(ds._inputs())
