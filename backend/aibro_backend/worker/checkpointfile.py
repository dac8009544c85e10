"""`.keras` checkpoints written straight from a weights snapshot: Keras' own save once, then byte patches.

Keras' `model.save` walks the model's whole object graph and creates every HDF5 dataset anew each time: 25-40 ms
of Python for a small model on the worker's pipeline thread, where it holds the GIL against the training loop
(whose per-step Python is most of a small model's epoch). Between two epochs only the variables' values change.
So the first checkpoint of a job is saved by Keras as before; then one more Keras save of the checkpoint copy, its
variable i filled with the sentinel i + 1, shows which byte range of `model.weights.h5` holds which variable, and
every later checkpoint is that file with those ranges overwritten by the snapshot's bytes (a few ms of memcpy).

Nothing is taken on trust: the learned writer must reproduce Keras' own first checkpoint from the same snapshot,
dataset for dataset and attribute for attribute, before it is used, and anything it does not expect (a dataset
Keras did not store contiguously and unfiltered, a dtype that cannot hold its sentinel, a dataset no variable
explains, assets or other files in the archive) keeps Keras' save for the whole job.
"""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from aibro_core.compat import keras as keras_compat

log = logging.getLogger("aibro.worker")
WEIGHTS = "model.weights.h5"
METADATA = "metadata.json"
MEMBERS = frozenset({METADATA, "config.json", WEIGHTS})
ZIP64_FROM = (1 << 31) - 1
# The writer keeps a template of the weights file in memory. Above this a Keras save is mostly writing bytes
# anyway, and the worker already holds the model twice (the live one and the checkpoint copy).
MAX_TEMPLATE_BYTES = 512 << 20


@dataclass(frozen=True)
class _Patch:
    """Where variable `index` lives in the weights file."""

    offset: int
    nbytes: int
    index: int
    dtype: np.dtype
    shape: tuple[int, ...]


class CheckpointFile:
    """Writes `.keras` files for one model's variables (weights, then optimizer variables, the snapshot's order).

    The archive's `config.json` and `metadata.json` come from the last Keras save it adopted. A config can hold a
    variable's value: the optimizer's learning rate, which callbacks such as ReduceLROnPlateau change. So `write`
    declines (returns False) when any scalar float variable differs from that save's, and the caller saves with
    Keras again and adopts that save."""

    def __init__(self, members: list[tuple[zipfile.ZipInfo, bytes]], patches: list[_Patch]) -> None:
        self._members = members
        self._patches = sorted(patches, key=lambda p: p.offset)
        self._scalars = [p.index for p in self._patches if p.shape == () and p.dtype.kind == "f"]
        self._adopted: bytes | None = None  # the scalar float variables' bytes in the adopted save

    @classmethod
    def learn(cls, copy: Any, scratch: Path) -> CheckpointFile | None:
        """The writer for `copy`'s layout, or None where its Keras save is not one this writer can reproduce.
        Overwrites `copy`'s variables (with sentinels): the caller assigns the next snapshot before using it.
        It writes nothing until it has adopted a Keras save (`adopt`)."""
        variables = list(copy.weights) + list(copy.optimizer.variables)
        size = sum(math.prod(var.shape) * np.dtype(_dtype_name(var)).itemsize for var in variables)
        if size > MAX_TEMPLATE_BYTES:
            return _refuse(f"the variables take {size / 2**20:.0f} MiB (the writer keeps a copy in memory)")
        for i, var in enumerate(variables):
            dtype = np.dtype(_dtype_name(var))
            sentinel = np.full(tuple(var.shape), i + 1, dtype=dtype) if dtype.kind in "fiu" else None
            if sentinel is None or sentinel.size == 0 or not (sentinel == i + 1).all():
                return _refuse(f"variable {var.path} ({dtype}, shape {tuple(var.shape)}) cannot hold its sentinel")
            var.assign(sentinel)
        path = scratch / "layout.keras"
        copy.save(path)
        try:
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
                if {i.filename for i in infos} != MEMBERS or len(infos) != len(MEMBERS):
                    return _refuse(f"the archive holds {sorted(i.filename for i in infos)}")
                members = [(info, zf.read(info)) for info in infos]
        finally:
            path.unlink(missing_ok=True)
        weights = next(data for info, data in members if info.filename == WEIGHTS)
        patches: dict[int, _Patch] = {}
        with h5py.File(io.BytesIO(weights), "r") as h5:
            for name, ds in _datasets(h5):
                patch = _locate(ds, len(variables))
                if patch is None or patch.index in patches:
                    return _refuse(f"dataset {name} does not hold exactly one variable's sentinel")
                if patch.shape != tuple(variables[patch.index].shape):
                    return _refuse(f"dataset {name} has shape {patch.shape}")
                patches[patch.index] = patch
        if len(patches) != len(variables):
            return _refuse(f"{len(variables) - len(patches)} variables are not in the weights file")
        return cls(members, list(patches.values()))

    def adopt(self, saved: Path, values: list[np.ndarray], scratch: Path, check: bool) -> bool:
        """Take the config and metadata of `saved`, Keras' own save of `values`, for the files written from now
        on. With `check`, first make sure this writer reproduces that save from the same values (every group,
        attribute and dataset of the weights file, and the archive's file list); False if it does not."""
        with zipfile.ZipFile(saved) as zf:
            theirs = {info.filename: (info, zf.read(info)) for info in zf.infolist()}
        if set(theirs) != MEMBERS:
            return False
        members = [
            (theirs[info.filename][0], data if info.filename == WEIGHTS else theirs[info.filename][1])
            for info, data in self._members
        ]
        if check:
            mine = scratch / "check.keras"
            try:
                self._write(values, mine, members)
                with zipfile.ZipFile(mine) as zf:
                    ours = zf.read(WEIGHTS)
                    if sorted(zf.namelist()) != sorted(theirs):
                        return False
            finally:
                mine.unlink(missing_ok=True)
            with h5py.File(io.BytesIO(ours), "r") as ha, h5py.File(io.BytesIO(theirs[WEIGHTS][1]), "r") as hb:
                if not _same_tree(ha, hb):
                    return False
        self._members = members
        self._adopted = self._scalar_bytes(values)
        return True

    def write(self, values: list[np.ndarray], path: Path) -> bool:
        """Write the `.keras` file of these variable values (the snapshot's order), as Keras would save it; False
        (nothing written) before a Keras save was adopted or when a config-visible scalar changed since."""
        if self._adopted is None or self._scalar_bytes(values) != self._adopted:
            return False
        self._write(values, path, self._members)
        return True

    def _write(self, values: list[np.ndarray], path: Path, members: list[tuple[zipfile.ZipInfo, bytes]]) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            for info, data in members:
                if info.filename == WEIGHTS:
                    with zf.open(_now(info), "w", force_zip64=len(data) > ZIP64_FROM) as out:
                        self._write_weights(values, memoryview(data), out)
                elif info.filename == METADATA:
                    zf.writestr(info, _stamped(data))
                else:
                    zf.writestr(info, data)

    def _scalar_bytes(self, values: list[np.ndarray]) -> bytes:
        return b"".join(np.asarray(values[i]).tobytes() for i in self._scalars)

    def _write_weights(self, values: list[np.ndarray], template: memoryview, out: Any) -> None:
        pos = 0
        for p in self._patches:
            arr = np.asarray(values[p.index], dtype=p.dtype, order="C")
            if arr.shape != p.shape:
                raise ValueError(f"variable {p.index} has shape {arr.shape}, the checkpoint layout {p.shape}")
            out.write(template[pos : p.offset])
            out.write(memoryview(arr.reshape(-1)).cast("B"))
            pos = p.offset + p.nbytes
        out.write(template[pos:])


def _dtype_name(var: Any) -> str:
    dtype = var.dtype
    return dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype))


def _refuse(why: str) -> None:
    log.info("checkpoints keep Keras' own save: %s", why)
    return None


def _datasets(h5: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    found: list[tuple[str, h5py.Dataset]] = []
    h5.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, h5py.Dataset) else None)
    return found


def _locate(ds: h5py.Dataset, count: int) -> _Patch | None:
    """The dataset's byte range and the variable whose sentinel fills it; None if it is not that simple."""
    plist = ds.id.get_create_plist()
    offset = ds.id.get_offset()
    dtype = ds.dtype
    native = dtype.byteorder in ("=", "|") or dtype.byteorder == ("<" if sys.byteorder == "little" else ">")
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or offset is None or not native:
        return None
    if dtype.kind not in "fiu" or ds.id.get_storage_size() != ds.size * dtype.itemsize or ds.size == 0:
        return None
    values = ds[()]
    first = np.asarray(values).reshape(-1)[0]
    if not (values == first).all() or first != int(first) or not 1 <= int(first) <= count:
        return None
    return _Patch(offset, ds.size * dtype.itemsize, int(first) - 1, dtype.newbyteorder("="), tuple(ds.shape))


def _same_tree(a: h5py.Group, b: h5py.Group) -> bool:
    """Same groups, datasets (dtype, shape, bytes) and attributes."""
    if sorted(a.keys()) != sorted(b.keys()) or _attrs(a) != _attrs(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, h5py.Dataset) != isinstance(y, h5py.Dataset):
            return False
        if isinstance(x, h5py.Dataset):
            if x.dtype != y.dtype or x.shape != y.shape or _attrs(x) != _attrs(y):
                return False
            if np.asarray(x[()]).tobytes() != np.asarray(y[()]).tobytes():
                return False
        elif not _same_tree(x, y):
            return False
    return True


def _attrs(obj: h5py.HLObject) -> dict[str, str]:
    return {key: repr(value) for key, value in obj.attrs.items()}


def _now(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    fresh = zipfile.ZipInfo(info.filename, time.localtime()[:6])
    fresh.compress_type = info.compress_type
    fresh.external_attr = info.external_attr
    return fresh


def _stamped(metadata: bytes) -> bytes:
    """Keras' metadata with this save's date, in Keras' format."""
    try:
        meta = json.loads(metadata)
    except ValueError:
        return metadata
    if isinstance(meta, dict) and "date_saved" in meta:
        meta["date_saved"] = time.strftime("%Y-%m-%d@%H:%M:%S")
        return json.dumps(meta).encode()
    return metadata


def cache_keras_save_walk() -> None:
    """Keras 3 (through 3.15 at least) stores the attribute skip-sets its save walk computes under one key
    (`saving_attr_skipset_*`) and looks them up under another (`saving_attr_skiplist_*`), so every `model.save`
    builds throwaway Layer and Optimizer objects again: about a third of a small model's save. Storing each set
    under the key Keras reads makes the lookup hit; where a Keras version reads the key it writes, this is a no-op."""
    try:
        keras_compat.precompute_save_skipsets(
            ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer", "Loss")
        )
    except Exception as exc:  # noqa: BLE001 - a private API: only speed depends on it
        log.info("could not pre-compute Keras' save walk (%s); saves take their usual time", exc)
