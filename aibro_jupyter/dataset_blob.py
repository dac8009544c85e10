"""A finite `tf.data.Dataset` → one deterministic tar of its `Dataset.save` output, so it uploads once.

`Dataset.save` writes a random run id and a timestamp; both are fixed here, so the same elements give the same
bytes and the content-addressed store skips the upload the second time. The worker loads it back with
`Dataset.load` (protobuf and raw tensors, no pickle). The dataset travels as the elements of one pass: what its
pipeline randomises (`.shuffle`, random augmentation) is drawn once, here, not again every remote epoch."""

from __future__ import annotations

import os
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core.compat import tensorflow as tf_compat

from .errors import ValidationError

RUN_ID = "0"


def is_dataset(value: Any) -> bool:
    """True for a tf.data.Dataset, without importing TensorFlow for users who never made one."""
    return type(value).__module__.startswith("tensorflow") and hasattr(value, "element_spec")


def is_pydataset(value: Any) -> bool:
    """A keras.utils.PyDataset (keras.utils.Sequence): each item one batch, as fit reads it."""
    if not hasattr(value, "__getitem__") or isinstance(value, (str, bytes, list, tuple, dict)):
        return False
    import keras

    return isinstance(value, keras.utils.PyDataset)


def from_pydataset(ds: Any, name: str) -> Any:
    """A PyDataset as the tf.data.Dataset of its batches, one item each, in order: what fit draws from it in an
    epoch, so it travels as any dataset does (as one drawn pass: an item that draws at random draws once)."""
    import tensorflow as tf

    try:
        count = len(ds)
    except (TypeError, NotImplementedError):
        count = None
    if not count:
        raise ValidationError(
            f"{name} is a keras.utils.PyDataset with no length (endless, or empty): give it a __len__ (its number of "
            "batches), or make a tf.data.Dataset of the batches to train on"
        )
    first = ds[0]

    def spec(value: Any) -> Any:
        arr = np.asarray(value)
        return tf.TensorSpec(shape=(None, *arr.shape[1:]), dtype=tf.as_dtype(arr.dtype))

    signature = tf.nest.map_structure(spec, _as_tuples(first))

    def batches() -> Any:
        for i in range(count):
            yield _as_tuples(ds[i])

    made = tf.data.Dataset.from_generator(batches, output_signature=signature)
    return made.apply(tf.data.experimental.assert_cardinality(count))


def _as_tuples(item: Any) -> Any:
    """A batch as tf.data takes it: lists (which Keras reads as (x, y)) become tuples, arrays stay."""
    if isinstance(item, list):
        return tuple(_as_tuples(v) for v in item)
    if isinstance(item, tuple):
        return tuple(_as_tuples(v) for v in item)
    if isinstance(item, dict):
        return {k: _as_tuples(v) for k, v in item.items()}
    return np.asarray(item)


def check_dataset(ds: Any, name: str, model: Any = None, steps: int | None = None) -> None:
    """Refuse a dataset that cannot travel or cannot train, naming the fix, before anything is saved. `steps` is
    what bounds an epoch of it (steps_per_epoch, or validation_steps for validation data)."""
    import tensorflow as tf

    cardinality = int(ds.cardinality())
    if cardinality == int(tf.data.INFINITE_CARDINALITY) and not steps:
        what = "steps_per_epoch" if name == "x" else "validation_steps"
        raise ValidationError(
            f"{name} is an infinite tf.data.Dataset (.repeat() with no count), so an epoch of it never ends: pass "
            f"{what}=N (as fit needs for it in the kernel too), or drop .repeat() (fit goes over the dataset once "
            "per epoch), or bound it with .take(n)"
        )
    if cardinality == 0:
        raise ValidationError(f"{name} is an empty tf.data.Dataset: it yields no batches to train on")
    spec = ds.element_spec
    if (not isinstance(spec, tuple) or len(spec) not in (2, 3)) and not _own_train_step(model):
        raise ValidationError(
            f"{name} yields {_describe(spec)}, but model.fit needs (inputs, targets) or (inputs, targets, "
            "sample_weights) from a dataset: build it from a pair, e.g. Dataset.from_tensor_slices((x, y)).batch(64)"
        )
    inputs = getattr(model, "inputs", None) if model is not None else None
    x_spec = spec[0] if isinstance(spec, tuple) else spec
    if inputs and len(inputs) == 1 and isinstance(x_spec, tf.TensorSpec) and _one_sample(x_spec, inputs[0]):
        raise ValidationError(
            f"{name} yields single samples of shape {tuple(x_spec.shape)}, not batches (the model expects "
            f"{tuple(inputs[0].shape)}): add .batch(batch_size) to the dataset"
        )
    if _shuffles(ds):
        warnings.warn(
            f"{name} shuffles in its pipeline; it travels as one saved pass, so every remote epoch sees the same "
            "order. Pass numpy arrays instead to have fit reshuffle every epoch.",
            stacklevel=4,
        )


def _own_train_step(model: Any) -> bool:
    """Whether a batch of inputs alone is something this model's fit trains on, as Keras' own fit then does: its
    class brings its own train_step or compute_loss (an autoencoder, a GAN), or compile() was given no loss (the
    model adds its own with add_loss). Unknown (no model: a HyperModel's fit makes the batches) counts as yes."""
    import keras

    if model is None:
        return True
    if not isinstance(model, keras.Model):
        return False
    for method in ("train_step", "compute_loss"):
        own = getattr(type(model), method, None)
        if own is not None and not str(getattr(own, "__module__", "")).startswith("keras"):
            return True
    return getattr(model, "loss", None) is None


def travelling_pass(ds: Any, steps: int | None, epochs: int) -> tuple[Any, bool]:
    """What of `ds` travels, and whether the worker repeats it: a finite dataset as it is; `.repeat()` of a finite
    one as that one, repeated again there; any other endless one as the batches fit will draw, `steps` per epoch."""
    import tensorflow as tf

    if int(ds.cardinality()) != int(tf.data.INFINITE_CARDINALITY):
        return ds, False
    node = ds
    while tf_compat.stage_kind(node) in ("PrefetchDataset", "OptionsDataset"):  # dropped: the worker prefetches
        node = tf_compat.dataset_input(node)
    if tf_compat.stage_kind(node) == "RepeatDataset" and tf_compat.repeat_count(node) == -1:
        inner = tf_compat.dataset_input(node)
        if int(inner.cardinality()) >= 0:
            return inner, True
    return ds.take(int(steps or 0) * epochs), False


def _one_sample(x_spec: Any, model_input: Any) -> bool:
    """Whether the dataset yields single samples rather than batches: its element has the model's input shape
    without the batch axis, and a known first dimension (a batch's is unknown unless drop_remainder=True). A
    batch of shape (None,) for an input of shape (None, 1) is a batch: Keras adds the trailing axis itself."""
    if x_spec.shape.rank is None:
        return False
    have = tuple(x_spec.shape)
    want = tuple(model_input.shape)
    if len(have) != len(want) - 1 or not have or have[0] is None:
        return False
    if want[-1] == 1 and _dims_match(have, want[:-1]):
        return False
    return _dims_match(have, want[1:])


def _dims_match(have: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    return len(have) == len(want) and all(h is None or w is None or h == w for h, w in zip(have, want))


def _describe(spec: Any) -> str:
    if isinstance(spec, tuple):
        return f"tuples of {len(spec)}"
    return f"single {type(spec).__name__} elements"


def _shuffles(ds: Any) -> bool:
    """Whether a shuffle stage sits anywhere in the pipeline (walking TensorFlow's input graph)."""
    seen, stack = set(), [ds]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if "Shuffle" in type(node).__name__:
            return True
        try:
            stack.extend(tf_compat.dataset_inputs(node))
        except Exception:  # noqa: BLE001 - a dataset kind without inputs: nothing upstream to look at
            continue
    return False


def save_dataset(ds: Any, path: Path) -> Path:
    """Save `ds` and pack it as a deterministic tar at `path`."""
    from tensorflow.core.protobuf import snapshot_pb2

    folder = path.with_suffix(".saved")
    ds.save(str(folder))
    meta = snapshot_pb2.SnapshotMetadataRecord()
    meta.ParseFromString((folder / "snapshot.metadata").read_bytes())
    (folder / meta.run_id).rename(folder / RUN_ID)
    meta.run_id, meta.creation_timestamp = RUN_ID, 0
    (folder / "snapshot.metadata").write_bytes(meta.SerializeToString())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the user's data, as private as the other blobs whatever the kernel's umask
    with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(file.relative_to(folder).as_posix())
            info.size, info.mode = file.stat().st_size, 0o600
            with open(file, "rb") as f:
                tar.addfile(info, f)
    return path
