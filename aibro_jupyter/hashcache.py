"""What an array's SHA-256 is without hashing it again: the resubmit of a 1 GiB array decides "already there" in
milliseconds where its bytes cannot have changed, and in one fast fingerprint pass where they can.

* Exact, without reading a byte, for bytes that cannot change behind our back. A memmap opened read-only
  (``mode='r'``, e.g. ``np.load(path, mmap_mode='r')``) is named by its file (device, inode, size, mtime) and where
  the view starts in it, so this holds across kernel restarts (kept in ``AIBRO_HOME/hashes.json``); an in-memory
  array that is read-only all the way down to memory it owns (``x.flags.writeable = False``) is named by that
  owner object, held by a weak reference (a freed array's address may be reused). Taken at its word: flipping the
  flag back and writing defeats it, as it would any read-only contract.
* By fingerprint, for writable arrays, whose bytes may change at any time (``x /= 255`` in place): xxh3-128 over all
  of the .npy bytes (8-12 GB/s on two threads against SHA-256's 1.2 GB/s here) maps to the SHA-256 those bytes had.
  Any change to any byte changes it (an accidental collision is a 2^-128 event; the file is the user's own, 0600),
  and the backend still checks the SHA-256 of whatever it receives. An unknown fingerprint means new data: it
  uploads in one pass and the backend names it.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from aibro_core.files import write_private

MAX_ENTRIES = 512  # per kind; the oldest go first


class HashCache:
    """Process-wide (one per kernel); the file-backed entries persist so a restarted kernel keeps them."""

    def __init__(self, path: Callable[[], Path | None] = lambda: None) -> None:
        """`path` says where the persistent entries live now (the AIBRO_HOME of the moment; None: in memory)."""
        self.path = path
        self._lock = threading.Lock()
        self._owned: OrderedDict[tuple[Any, ...], tuple[weakref.ref, str]] = OrderedDict()
        self._files: OrderedDict[str, str] = OrderedDict()
        self._prints: OrderedDict[str, str] = OrderedDict()
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

    def remember(self, arr: np.ndarray, sha: str, fingerprint: str | None = None) -> None:
        """Record `arr`'s SHA-256: by identity when its bytes are immutable, else by its fingerprint."""
        key = _exact_key(arr)
        with self._lock:
            self._load()
            if key is not None and key[0] == "file":
                _put(self._files, key[1], sha)
            elif key is not None:
                _put(self._owned, key[1:], (weakref.ref(_owner(arr)), sha))
            if fingerprint is not None:
                _put(self._prints, fingerprint, sha)
            self._save()

    def forget(self, arr: np.ndarray, fingerprint: str | None = None) -> None:
        """Drop what is known of `arr` (the backend found its bytes differ from the name the cache gave)."""
        key = _exact_key(arr)
        with self._lock:
            if key is not None and key[0] == "file":
                self._files.pop(key[1], None)
            elif key is not None:
                self._owned.pop(key[1:], None)
            if fingerprint is not None:
                self._prints.pop(fingerprint, None)
            self._save()

    # -- fingerprint ----------------------------------------------------------------------------------------
    def by_print(self, fingerprint: str) -> str | None:
        """The SHA-256 recorded for bytes with this fingerprint, if any."""
        with self._lock:
            self._load()
            return self._prints.get(fingerprint)

    # -- persistence ----------------------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.path()
        if self._loaded is not False and self._loaded == path:
            return
        self._loaded = path
        self._files.clear()
        self._prints.clear()
        if path is None:
            return
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        for name, into in (("files", self._files), ("prints", self._prints)):
            for k, v in list((data.get(name) or {}).items())[-MAX_ENTRIES:]:
                if isinstance(k, str) and isinstance(v, str):
                    into[k] = v

    def _save(self) -> None:
        path = self.path()
        if path is None or path != self._loaded:
            return
        try:
            write_private(path, {"files": dict(self._files), "prints": dict(self._prints)})
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


def fingerprint(chunks: Iterable[memoryview]) -> str:
    """xxh3-128 of the bytes (all of them, at memory speed): recognises bytes seen before; never their name. The
    even and the odd chunks are hashed on two threads (xxhash lets go of the GIL), and the two digests together."""
    pieces = list(chunks)
    halves = [xxhash.xxh3_128(), xxhash.xxh3_128()]

    def run(i: int) -> None:
        for chunk in pieces[i::2]:
            halves[i].update(chunk)

    other = threading.Thread(target=run, args=(1,), name="aibro-fingerprint", daemon=True)
    other.start()
    run(0)
    other.join()
    return "2:" + xxhash.xxh3_128(halves[0].digest() + halves[1].digest()).hexdigest()


def _cache_file() -> Path:
    from .config import home

    return home() / "hashes.json"


CACHE = HashCache(_cache_file)
