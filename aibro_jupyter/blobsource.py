"""Bytes to upload, read from where they already are (an array's own buffer, a file, a bytes object): hashing and
uploading walk the same view, so no array is ever copied to a temp file first. An array also says what is known
of its name (hashcache.py): known without reading it, known by its fingerprint, or new (one pass, named by the
backend)."""

from __future__ import annotations

import hashlib
import io
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .hashcache import CACHE, fingerprint

CHUNK = 8 * 1024 * 1024
SEND_LARGE = 64 * 1024 * 1024  # an array's buffer: sent without a copy, so a request can carry more
ONE_PASS_MIN = 64 * 1024 * 1024  # smaller arrays are hashed first: cheap, and the backend can say "have it"
FINGERPRINT_MIN = 4 * 1024 * 1024  # below it a SHA-256 pass costs under 3 ms: no fingerprint kept


class ByteSource:
    """A byte stream of known size that can be read again from any offset (to hash, to upload, to resume)."""

    size: int
    name: str
    send_size: int = CHUNK  # bytes per PUT: a file is read into memory a chunk at a time

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        raise NotImplementedError

    def sha256(self) -> str:
        h = hashlib.sha256()
        for chunk in self.chunks():
            h.update(chunk)
        return h.hexdigest()

    def known_sha(self) -> str | None:
        """The SHA-256 when it is known without reading the bytes (see hashcache.py); None: hash them."""
        return None

    def maybe_new(self) -> bool:
        """True when these bytes were probably never sent: they may upload in one pass, named at the end, at the
        cost of not asking the backend first. Only large arrays say so; files and small things are hashed first."""
        return False

    def remember(self, sha: str) -> None:
        """These bytes are named `sha` (after hashing or uploading them)."""

    def forget(self) -> None:
        """The name `known_sha` gave was wrong (the bytes changed): do not give it again."""

    def upload_id(self) -> str:
        """The id of a one-pass upload of these bytes (`maybe_new`): the same for the same bytes, in this kernel or
        the next, so an upload cut off (its kernel killed mid-body) is resumed, not begun again beside it."""
        return secrets.token_hex(16)

    def read(self, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end): one part of a multipart upload."""
        out = bytearray()
        for chunk in self.chunks(start, max(1, min(length, CHUNK))):
            out += chunk[: length - len(out)]
            if len(out) >= length:
                break
        return bytes(out)

    def view(self, start: int, length: int) -> bytes | memoryview:
        """`read`, without a copy where the source can give one (an array's buffer): one part of a multipart
        upload, however many are in flight."""
        return self.read(start, length)


@dataclass
class BytesSource(ByteSource):
    data: bytes
    name: str = "bytes"
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.data)

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        view = memoryview(self.data)
        for off in range(start, self.size, size):
            yield view[off : off + size]


@dataclass
class FileSource(ByteSource):
    path: Path
    name: str = "file"
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = Path(self.path).stat().st_size

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        with open(self.path, "rb") as f:
            f.seek(start)
            while chunk := f.read(size):
                yield memoryview(chunk)


class ArraySource(ByteSource):
    """An array as the bytes `np.save(..., allow_pickle=False)` would write: a .npy header, then the array's own
    buffer (a numpy array or a memmap, read in place; only a non-contiguous array is made contiguous first)."""

    send_size = SEND_LARGE

    def __init__(self, arr: np.ndarray, name: str = "array") -> None:
        if arr.dtype.hasobject:
            raise ValueError("object arrays cannot travel without pickle")
        self.arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        self.name = name
        header = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": arr.shape}
        buf = io.BytesIO()
        try:
            np.lib.format.write_array_header_1_0(buf, header)
        except ValueError:
            buf = io.BytesIO()
            np.lib.format.write_array_header_2_0(buf, header)
        self.header = buf.getvalue()
        self.size = len(self.header) + self.arr.nbytes
        self._print: str | None = None

    def known_sha(self) -> str | None:
        sha = CACHE.known(self.arr)
        if sha is None and self.size >= FINGERPRINT_MIN:
            sha = CACHE.by_print(self.fingerprint())
        return sha

    def maybe_new(self) -> bool:
        return self.size >= ONE_PASS_MIN and self.known_sha() is None

    def fingerprint(self) -> str:
        if self._print is None:
            self._print = fingerprint(self.chunks())
        return self._print

    def upload_id(self) -> str:
        """From the fingerprint `maybe_new` computed (every byte, at memory speed) and the size: the same array
        resumes the upload a killed kernel began (an array changed since is another upload)."""
        return hashlib.sha256(f"one-pass {self.size} {self.fingerprint()}".encode()).hexdigest()[:32]

    def remember(self, sha: str) -> None:
        CACHE.remember(self.arr, sha, self.fingerprint() if self.size >= FINGERPRINT_MIN else None)

    def forget(self) -> None:
        CACHE.forget(self.arr, self._print)

    def _flat(self) -> memoryview:
        if self.arr.nbytes == 0:
            return memoryview(b"")
        return memoryview(self.arr.reshape(-1).view(np.uint8))

    def view(self, start: int, length: int) -> bytes | memoryview:
        head = len(self.header)
        if start >= head:
            return self._flat()[start - head : start - head + length]
        return self.read(start, length)  # the part with the .npy header: copied, once

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        head = len(self.header)
        if start < head:
            yield memoryview(self.header)[start:]
            start = head
        flat = self._flat()
        for off in range(start - head, self.arr.nbytes, size):
            yield flat[off : off + size]
