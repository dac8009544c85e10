"""Bytes to upload, read from where they already are (an array's own buffer, a file, a bytes object): hashing and
uploading walk the same view, so no array is ever copied to a temp file first."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHUNK = 8 * 1024 * 1024


class ByteSource:
    """A byte stream of known size that can be read again from any offset (to hash, to upload, to resume)."""

    size: int
    name: str

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        raise NotImplementedError

    def sha256(self) -> str:
        h = hashlib.sha256()
        for chunk in self.chunks():
            h.update(chunk)
        return h.hexdigest()

    def read(self, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end): one part of a multipart upload."""
        out = bytearray()
        for chunk in self.chunks(start, max(1, min(length, CHUNK))):
            out += chunk[: length - len(out)]
            if len(out) >= length:
                break
        return bytes(out)


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

    def _flat(self) -> memoryview:
        if self.arr.nbytes == 0:
            return memoryview(b"")
        return memoryview(self.arr.reshape(-1).view(np.uint8))

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[memoryview]:
        head = len(self.header)
        if start < head:
            yield memoryview(self.header)[start:]
            start = head
        flat = self._flat()
        for off in range(start - head, self.arr.nbytes, size):
            yield flat[off : off + size]
