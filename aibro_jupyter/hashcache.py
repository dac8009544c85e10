"""What an array's SHA-256 is without reading it all again, where that is safe, and a hint of whether the backend
has likely seen it: the resubmit of a 1 GiB array decides "already there" from its identity.

Two kinds of knowledge, kept apart because only one is safe to act on alone:

* `known(arr)`: exact, for bytes that cannot change behind our back. A memmap opened read-only (``mode='r'``,
  e.g. ``np.load(path, mmap_mode='r')``) is named by its file (device, inode, size, mtime) and where the view
  starts in it, so this holds across kernel restarts (kept in ``~/.aibro/hashes.json``); an in-memory array that
  is read-only all the way down to memory it owns (``x.flags.writeable = False``) is named by that owner object,
  held by a weak reference (a freed array's address may be reused). Taken at its word: flipping the flag back
  and writing defeats it, as it would any read-only contract.
* `seen(arr)`: a hint for writable arrays, whose bytes may change at any time (``x /= 255`` in place): a digest of
  their shape, dtype and ~300 KiB sampled across the buffer, mapped to the SHA-256 it had. A hit means "probably
  sent before": the caller hashes in full first (the hash decides, never the hint), so a resubmit uploads 0 bytes;
  a miss means "new data": upload and hash in one pass, and name the blob at the end.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core.files import write_private

MAX_ENTRIES = 512  # per kind; the oldest go first
SAMPLES = 64  # slices of SAMPLE_BYTES spread across the buffer, plus its first and last MiB
SAMPLE_BYTES = 4096
_EDGE = 1 << 20


class HashCache:
    """Process-wide (one per kernel); the file-backed entries persist so a restarted kernel keeps them."""

    def __init__(self, path: Callable[[], Path | None] = lambda: None) -> None:
        """`path` says where the persistent entries live now (the AIBRO_HOME of the moment; None: in memory)."""
        self.path = path
        self._lock = threading.Lock()
        self._owned: OrderedDict[tuple[Any, ...], tuple[weakref.ref, str]] = OrderedDict()
        self._files: OrderedDict[str, str] = OrderedDict()
        self._seen: OrderedDict[str, str] = OrderedDict()
        self._loaded: Path | None | bool = False

    # -- exact ----------------------------------------------------------------------------------------------
    def known(self, arr: np.ndarray) -> str | None:
        """The SHA-256 of `arr`'s .npy bytes when its bytes cannot have changed since they were hashed."""
        key = _exact_key(arr)
        if key is None:
            return None
        with self._lock:
            if key[0] == "file":
                self._load()
                return self._files.get(key[1])
            entry = self._owned.get(key[1:])
            if entry is None:
                return None
            ref, sha = entry
            owner = ref()
            if owner is None or owner is not _owner(arr) or _writable_chain(arr):
                self._owned.pop(key[1:], None)
                return None
            return sha

    def remember(self, arr: np.ndarray, sha: str) -> None:
        """Record `arr`'s SHA-256: exactly when its bytes are immutable, and as a hint for a writable array."""
        key = _exact_key(arr)
        with self._lock:
            if key is not None and key[0] == "file":
                self._load()
                _put(self._files, key[1], sha)
                self._save()
            elif key is not None:
                _put(self._owned, key[1:], (weakref.ref(_owner(arr)), sha))
            self._load()
            _put(self._seen, sample_key(arr), sha)
            self._save()

    def forget(self, arr: np.ndarray) -> None:
        """Drop what is known of `arr` (the backend found its bytes differ from the name the cache gave)."""
        key = _exact_key(arr)
        with self._lock:
            if key is not None and key[0] == "file":
                self._files.pop(key[1], None)
            elif key is not None:
                self._owned.pop(key[1:], None)
            self._seen.pop(sample_key(arr), None)
            self._save()

    # -- hint -----------------------------------------------------------------------------------------------
    def seen(self, arr: np.ndarray) -> bool:
        """True when an array that looks like this one (shape, dtype, sampled bytes) was hashed before."""
        key = sample_key(arr)
        with self._lock:
            self._load()
            return key in self._seen

    # -- persistence ----------------------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.path()
        if self._loaded is not False and self._loaded == path:
            return
        self._loaded = path
        self._files.clear()
        self._seen.clear()
        if path is None:
            return
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        for name, into in (("files", self._files), ("seen", self._seen)):
            for k, v in list((data.get(name) or {}).items())[-MAX_ENTRIES:]:
                if isinstance(k, str) and isinstance(v, str):
                    into[k] = v

    def _save(self) -> None:
        path = self.path()
        if path is None or path != self._loaded:
            return
        try:
            write_private(path, {"files": dict(self._files), "seen": dict(self._seen)})
        except OSError:
            pass  # a cache: losing it costs one hash pass


def _put(d: OrderedDict, key: Any, value: Any) -> None:
    d.pop(key, None)
    d[key] = value
    while len(d) > MAX_ENTRIES:
        d.popitem(last=False)


def _chain(arr: np.ndarray) -> list[Any]:
    """`arr`, its base, the base's base, ...: the objects its memory belongs to."""
    out: list[Any] = [arr]
    while isinstance(out[-1], np.ndarray) and out[-1].base is not None and len(out) < 64:
        out.append(out[-1].base)
    return out


def _owner(arr: np.ndarray) -> Any:
    return _chain(arr)[-1]


def _writable_chain(arr: np.ndarray) -> bool:
    return any(isinstance(a, np.ndarray) and a.flags.writeable for a in _chain(arr))


def _data_ptr(a: Any) -> int:
    return int(a.__array_interface__["data"][0])


def _exact_key(arr: np.ndarray) -> tuple[Any, ...] | None:
    """("file", key) for a view of a read-only memmap, ("owned", id, offset, shape, strides, dtype) for a read-only
    in-memory array, None when its bytes may change."""
    if not isinstance(arr, np.ndarray) or _writable_chain(arr):
        return None
    view = (tuple(arr.shape), tuple(arr.strides), arr.dtype.str)
    chain = _chain(arr)
    owner = chain[-1]
    if isinstance(owner, mmap.mmap):
        mm = next((a for a in chain if isinstance(a, np.memmap) and getattr(a, "filename", None)), None)
        if mm is None or getattr(mm, "mode", None) != "r":
            return None
        try:
            st = os.stat(mm.filename)
            base = _data_ptr(np.frombuffer(owner, dtype=np.uint8, count=1)) if len(owner) else 0
        except (OSError, ValueError, TypeError):
            return None
        start = int(mm.offset) - int(mm.offset) % mmap.ALLOCATIONGRANULARITY  # where numpy mapped the file from
        where = start + _data_ptr(arr) - base
        return ("file", json.dumps([str(mm.filename), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, where, *view]))
    if isinstance(owner, np.ndarray) and owner.flags.owndata:
        return ("owned", id(owner), _data_ptr(arr) - _data_ptr(owner), *view)
    return None


def sample_key(arr: np.ndarray) -> str:
    """A digest of shape, dtype and about 300 KiB sampled across the buffer: cheap, and only a hint."""
    h = hashlib.sha256(json.dumps([list(arr.shape), arr.dtype.str]).encode())
    if arr.nbytes:
        flat = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        n = len(flat)
        h.update(flat[:_EDGE])
        h.update(flat[max(0, n - _EDGE) :])
        step = max(1, n // SAMPLES)
        for off in range(0, n, step):
            h.update(flat[off : off + SAMPLE_BYTES])
    return h.hexdigest()


def _cache_file() -> Path:
    from .config import home

    return home() / "hashes.json"


CACHE = HashCache(_cache_file)
