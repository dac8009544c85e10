"""Data trees on the worker: arrays arrive as .npy blobs and load with allow_pickle=False (text as unicode
arrays, handed to Keras as Python strings); a tf.data dataset
arrives as a tar of its `Dataset.save` output and loads with `Dataset.load` (protobuf and raw tensors)."""

from __future__ import annotations

import os
import tarfile
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core.models import Data, DataNode, DataTop


def load_tree(tree: DataNode | None, fetch: Callable[[str], Path]) -> Any:
    if tree is None:
        return None
    if tree.blob is not None:
        arr = np.load(fetch(tree.blob), allow_pickle=False)
        if arr.dtype.kind in "US":  # text travels as a unicode array; Keras trains on Python strings (as given)
            if arr.ndim == 1:
                return arr.astype(object)
            import tensorflow as tf

            return tf.constant(arr)  # Keras takes text of more than one axis as a string tensor, not as objects
        return arr
    if isinstance(tree, DataTop) and tree.dataset is not None:
        ds = load_dataset(fetch(tree.dataset))
        if tree.shuffle_batches:  # a PyDataset's batches, which fit reorders each epoch
            ds = ds.shuffle(max(int(ds.cardinality()), 1), reshuffle_each_iteration=True)
        return ds.repeat() if tree.repeat else ds
    if tree.items is not None:
        return [load_tree(t, fetch) for t in tree.items]
    return {k: load_tree(t, fetch) for k, t in (tree.mapping or {}).items()}


def notebook_arrays(name: str, trees: dict[str, DataNode], fetch: Callable[[str], Path]) -> types.ModuleType:
    """The module the travelling definitions import the notebook's arrays from (a callback reading x_test): each
    loaded as the fit's arrays are, without pickle."""
    module = types.ModuleType(name, "the notebook's arrays its definitions read")
    for key, tree in trees.items():
        setattr(module, key, load_tree(tree, fetch))
    return module


def fit_data(data: Data, fetch: Callable[[str], Path]) -> tuple[Any, Any, Any, Any]:
    """A job spec's `data` → (x, y, sample_weight, validation_data) as the worker hands them to `model.fit`."""
    x, y, sw = (load_tree(part, fetch) for part in (data.x, data.y, data.sample_weight))
    val = data.validation
    validation_data = None
    if val is not None:
        parts = [load_tree(part, fetch) for part in (val.x, val.y, val.sample_weight)]
        validation_data = tuple(p for p in parts if p is not None)
    return x, y, sw, validation_data


def load_dataset(blob: Path) -> Any:
    """Unpack once per blob (a warm worker reuses it) with tarfile's 'data' filter (no links out, no devices), every
    file 0600.

    `Dataset.save` keeps the elements, not the pipeline: the kernel's `.prefetch` is gone, and each epoch reads the
    files again. So the loaded dataset prefetches, and one that fits the memory budget (CACHE_MAX_BYTES, a
    fraction of this machine's memory) is cached after its first epoch: the worker then feeds the model as the
    kernel's in-memory pipeline did (benchmarks/bench_foundation.py, section f)."""
    import tensorflow as tf

    folder = blob.with_name(blob.name + ".dataset")
    if not folder.is_dir():
        unpacked = Path(tempfile.mkdtemp(prefix="unpack-", dir=blob.parent))
        with tarfile.open(blob) as tar:
            tar.extractall(unpacked, filter=_private)
        unpacked.rename(folder)
    ds = tf.data.Dataset.load(str(folder))
    if sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) <= cache_max_bytes():
        ds = ds.cache()
    return ds.prefetch(tf.data.AUTOTUNE)


def _private(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's 'data' filter, and every file 0600 whatever mode the tar gives it (an older kernel's said 0644):
    the user's data is as private here as the blob it came in. Folders are made under the worker's umask (0700)."""
    member = tarfile.data_filter(member, dest)
    return member.replace(mode=0o600, deep=False) if member.isfile() else member


def cache_max_bytes() -> int:
    """The biggest saved dataset kept in memory after its first epoch: 1 GiB, or an eighth of physical memory."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        physical = 8 << 30
    return min(1 << 30, physical // 8)
