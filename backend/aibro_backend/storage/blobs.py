"""Artifact and upload storage in a local directory: content-addressed blobs and per-job artifacts.

Bytes go to disk as they arrive (`PartialWriter`), never through memory whole: a request body is appended to its
user's partial file chunk by chunk and hashed on the way in (`_Hashing`), so a finished upload is verified without
reading it back (only an upload resumed after a backend restart is hashed from disk), made durable (fsync) and
renamed into place. Partial uploads are bounded per user (`held`) and expire when left untouched (`sweep_partials`).

Blobs arrive two ways: named (`PUT /blobs/<sha>`: the client hashed first, so the backend can say "already here"
before any byte moves) and unnamed (`PUT /blobs/uploads/<id>`: one pass, the client hashes nothing
and the backend names the bytes by the digest it kept as they arrived, checking a name the client gives against it).
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from aibro_core.files import sha256_file

if TYPE_CHECKING:
    from .s3blobs import S3Backing

SHA_RE = re.compile(r"[0-9a-f]{64}")
ARTIFACT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,7}")
JOB_ID_RE = re.compile(r"[\w-]{1,128}")
UPLOAD_ID_RE = re.compile(r"[0-9a-f]{32}")


class BlobError(ValueError):
    """A bad upload: wrong offset, digest mismatch or bad name."""


class UploadBusy(BlobError):
    """Another connection is writing the same partial upload right now."""


def check_sha(sha: str) -> str:
    if not isinstance(sha, str) or not SHA_RE.fullmatch(sha):
        raise BlobError(f"'{sha[:80]}' is not a sha256 hex digest (64 lowercase hex characters)")
    return sha


def check_artifact_name(name: str) -> str:
    if not isinstance(name, str) or not ARTIFACT_NAME_RE.fullmatch(name) or ".." in name.split("/"):
        raise BlobError(
            f"artifact name '{name[:80]}' is not allowed: use letters, digits, '.', '_', '-' and '/' (no '..')"
        )
    return name


def artifact_conflict(names: Iterable[str], name: str) -> str | None:
    """Why `name` cannot be stored beside a job's artifacts `names`, or None: a name is a file or a folder of
    others ('a/b' makes 'a' a folder), so 'a/b' cannot join a file 'a', nor 'a' a folder holding 'a/b'."""
    for other in names:
        if name.startswith(other + "/"):
            return f"'{other}' is already a file of this job, so '{name}' cannot be stored inside it"
        if other.startswith(name + "/"):
            return f"'{name}' is already a folder of this job's artifacts (it holds '{other}')"
    return None


def check_upload_id(upload_id: str) -> str:
    if not isinstance(upload_id, str) or not UPLOAD_ID_RE.fullmatch(upload_id):
        raise BlobError(f"'{upload_id[:80]}' is not an upload id (32 lowercase hex characters the client picks)")
    return upload_id


RECEIVE_BUFFER = 1 << 20  # one body read from the socket into a writer's buffer
RECEIVE_BUFFERS = 8  # a writer's buffers: those in flight to the hash thread and the one being filled


class _Hashing:
    """The running SHA-256 of a partial file, fed by its writers: valid while it has seen every byte of the file.

    The hashing runs on a thread of its own (hashlib releases the GIL), so the event loop only receives and writes:
    a 1 GiB upload costs the loop its copies, not its 0.7 s of SHA-256. A piece handed with `done` is a lent
    buffer: `done` runs once it is hashed."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.count = 0
        self._queue: queue.Queue[tuple[bytes | memoryview, Callable[[], None] | None] | None] = queue.Queue(
            maxsize=32
        )  # at most 32 body pieces wait
        self._thread: threading.Thread | None = None

    def update(self, data: bytes | memoryview, done: Callable[[], None] | None = None) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="aibro-upload-hash", daemon=True)
            self._thread.start()
        self._queue.put((data, done))
        self.count += len(data)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            data, done = item
            self.h.update(data)
            if done is not None:
                done()

    def hexdigest(self) -> str:
        """Wait for what was queued (blocking: off the event loop) and give the digest."""
        self.close()
        return self.h.hexdigest()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class _Buffers:
    """A writer's receive buffers: the connection reads a body straight into one (server/bodyinto.py), the writer
    writes it and lends it to the hash thread, which gives it back. Bytes go from the socket to the disk and the
    hash without a copy or an allocation per piece."""

    def __init__(self, count: int = RECEIVE_BUFFERS, size: int = RECEIVE_BUFFER) -> None:
        self.count, self.size, self.made = count, size, 0
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()

    def take(self) -> bytearray:
        """A free buffer; waits for the hash thread when every one is in flight (as its queue's bound does)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self.made < self.count:
                self.made += 1
                return bytearray(self.size)
            return self._free.get()

    def give(self, buf: bytearray) -> None:
        self._free.put(buf)


class PartialWriter:
    """Appends one request's body to a partial upload as it arrives: at most `expect` bytes (what the request
    declared), never past `total`. The partial file is this writer's alone until `release`."""

    def __init__(self, store: BlobStore, path: Path, group: str, expect: int, total: int) -> None:
        self.store, self.path, self.group, self.expect, self.total = store, path, group, expect, total
        self.f = open(path, "ab")  # noqa: SIM115 - held open across the request's body chunks
        self.size = self.f.tell()
        self.written = 0
        hashing = store._hashing.get(path)
        if self.size == 0 or hashing is None or hashing.count != self.size:
            hashing = _Hashing() if self.size == 0 else None  # resumed without one: hashed from disk at the end
        if hashing is None or store._hashing.get(path) is not hashing:
            store._drop_hashing(path)
        if hashing is not None:
            store._hashing[path] = hashing
        self.hashing = hashing
        self._buffers = _Buffers()

    def buffer(self) -> memoryview:
        """Where the next bytes of the body go (the connection reads into it), then `filled`."""
        return memoryview(self._buffers.take())

    def filled(self, buf: memoryview, n: int) -> None:
        """The first `n` bytes of `buf` (from `buffer`) arrived: write them; the buffer is free again once hashed."""
        owner = buf.obj
        assert isinstance(owner, bytearray)
        self.write(buf[:n], lambda: self._buffers.give(owner))

    def write(self, data: bytes | memoryview, done: Callable[[], None] | None = None) -> None:
        """Append `data`; `done` runs when nothing holds it any more (a lent buffer)."""
        if self.written + len(data) > self.expect or self.size + len(data) > self.total:
            raise BlobError("the body is longer than its Content-Length or runs past the declared total")
        try:
            self.f.write(data)
        except OSError:
            self.store._drop_hashing(self.path)  # part of it may be on disk: hash from disk at the end
            self.hashing = None
            raise
        if self.hashing is not None:
            self.hashing.update(data, done)
        elif done is not None:
            done()
        self.size += len(data)
        self.written += len(data)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()

    def release(self) -> None:
        self.close()
        self.store._writers.pop(self.path, None)


class BlobStore:
    """Blobs live at blobs/<sha>; partial uploads at partial/<user>/<sha> and partial/job~<job>/<name>; artifacts at
    artifacts/<job>/<name>.

    With `s3` (the AWS provider configured), blobs and the workers' artifacts live in S3 instead and travel on
    presigned URLs (s3blobs.S3Backing); this directory then keeps only what the backend writes itself
    (history.json). The index of who owns which blob stays in the store either way."""

    def __init__(self, root: Path, s3: S3Backing | None = None) -> None:
        self.root = Path(root)
        self.s3 = s3
        for sub in ("blobs", "partial", "artifacts"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._writers: dict[Path, PartialWriter] = {}
        self._hashing: dict[Path, _Hashing] = {}

    def _drop_hashing(self, path: Path) -> None:
        hashing = self._hashing.pop(path, None)
        if hashing is not None:
            hashing.close()

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / check_sha(sha)

    def has_blob(self, sha: str) -> bool:
        return self.blob_path(sha).exists()

    def remove_blob(self, sha: str) -> None:
        """A blob no user holds any more: its bytes go (with the S3 backing they stay in the bucket)."""
        self.blob_path(sha).unlink(missing_ok=True)

    # -- partial uploads ----------------------------------------------------------------------------
    def _group(self, group: str) -> Path:
        """Partial uploads are grouped by who pays for them: a user's blobs (partial/<user>/), so nobody appends to
        or probes another's, and a job's artifacts (partial/job~<job>/)."""
        d = self.root / "partial" / group
        d.mkdir(exist_ok=True)
        return d

    def _partial(self, sha: str, owner: str) -> Path:
        return self._group(str(owner)) / check_sha(sha)

    def artifact_partial(self, job_id: str, name: str) -> Path:
        if not JOB_ID_RE.fullmatch(job_id):
            raise BlobError(f"'{job_id[:80]}' is not a job id")
        return self._group(f"job~{job_id}") / check_artifact_name(name).replace("/", "~")

    def _upload_partial(self, upload_id: str, owner: str) -> Path:
        return self._group(str(owner)) / f"up~{check_upload_id(upload_id)}"

    def received(self, sha: str, owner: str) -> int:
        """Bytes of this user's partial upload already here, so the client can resume where it stopped."""
        return _size(self._partial(sha, owner))

    def upload_received(self, upload_id: str, owner: str) -> int:
        return _size(self._upload_partial(upload_id, owner))

    def artifact_received(self, job_id: str, name: str) -> int:
        return _size(self.artifact_partial(job_id, name))

    def held(self, group: str) -> int:
        """Bytes a user (or a job, `job~<id>`) holds in unfinished uploads, counting what requests now in
        flight have declared but not yet sent: what the per-user quota bounds."""
        return self.pending(group)[0]

    def pending(self, group: str) -> tuple[int, int]:
        """(bytes, uploads) of a user's (or a job's) unfinished uploads: the bytes received and those requests now
        in flight declared, not the totals the uploads declared (those take no disk until they arrive)."""
        total, count = 0, 0
        with os.scandir(self._group(group)) as it:
            for entry in it:
                try:
                    total += entry.stat().st_size
                    count += 1
                except OSError:
                    pass
        return total + sum(w.expect - w.written for w in self._writers.values() if w.group == group), count

    def has_partial(self, sha: str, owner: str) -> bool:
        return self._partial(sha, owner).exists()

    def has_upload(self, upload_id: str, owner: str) -> bool:
        return self._upload_partial(upload_id, owner).exists()

    def open_partial(
        self, path: Path, group: str, offset: int, expect: int, total: int, restart: bool = False
    ) -> PartialWriter:
        """A writer appending `expect` bytes at `offset` of the partial file at `path` (which must hold exactly
        `offset` bytes; with `restart`, offset 0 starts it over), up to `total`. One writer per file at a time."""
        if path in self._writers:
            raise UploadBusy("another upload of this file is in progress: wait for it, or retry in a few seconds")
        have = _size(path)
        if restart and offset == 0 and have:
            path.unlink()
            self._drop_hashing(path)
            have = 0
        if offset != have:
            raise BlobError(f"chunk starts at byte {offset} but {have} bytes are stored: resume from {have}")
        if offset + expect > total:
            raise BlobError(f"chunk ends at byte {offset + expect}, past the declared total of {total}")
        writer = PartialWriter(self, path, group, expect, total)
        self._writers[path] = writer
        return writer

    def open_blob_chunk(self, sha: str, owner: str, offset: int, expect: int, total: int) -> PartialWriter:
        return self.open_partial(self._partial(sha, owner), str(owner), offset, expect, total)

    def open_upload_chunk(self, upload_id: str, owner: str, offset: int, expect: int, total: int) -> PartialWriter:
        return self.open_partial(self._upload_partial(upload_id, owner), str(owner), offset, expect, total)

    def digest(self, part: Path) -> str:
        """The SHA-256 of a complete partial file: from the hash its writers kept, or read from disk when it was
        resumed without one (after a backend restart, or a failed write)."""
        hashing = self._hashing.pop(part, None)
        if hashing is not None and hashing.count == _size(part):
            return hashing.hexdigest()
        if hashing is not None:
            hashing.close()
        return sha256_file(part)

    def _publish(self, part: Path, sha: str) -> None:
        """Make the verified upload the blob `sha`, durable before it has that name; a copy already there wins."""
        if self.has_blob(sha):
            part.unlink()
            return
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(part, self.blob_path(sha))

    def finish_blob(self, sha: str, owner: str) -> None:
        """Verify the complete partial upload and move it into place (blocking: run it off the event loop).

        A blob that already exists (another user sent the same bytes) is still received in full and
        verified: holding the digest alone never grants the content.
        """
        part = self._partial(sha, owner)
        digest = self.digest(part)
        if digest != sha:
            part.unlink()
            raise BlobError(f"upload digest {digest} does not match the name {sha}: upload it again from offset 0")
        self._publish(part, sha)

    def finish_upload(self, upload_id: str, owner: str, size: int, sha: str | None = None) -> str:
        """An unnamed upload of `size` bytes is complete: it becomes the blob named by the backend's own digest
        (which must equal `sha` when the client gave one); returns that name (blocking: run it off the event loop)."""
        part = self._upload_partial(upload_id, owner)
        if part in self._writers:
            raise UploadBusy("this upload is still receiving a chunk: finish it after the last PUT is answered")
        have = _size(part)
        if not part.exists() or have != size:
            raise BlobError(
                f"upload {upload_id} holds {have} of its {size} bytes: PUT the rest (from ?offset={have}) first"
            )
        digest = self.digest(part)
        if sha is not None and digest != sha:
            part.unlink()
            raise BlobError(f"the bytes uploaded hash to {digest}, not {sha}: upload them again")
        self._publish(part, digest)
        return digest

    def write_chunk(self, sha: str, owner: str, offset: int, data: bytes, total: int) -> bool:
        """Append one chunk at `offset`; return True when the whole upload is here and hashes to `sha`."""
        writer = self.open_blob_chunk(sha, owner, offset, len(data), total)
        try:
            writer.write(data)
        finally:
            writer.release()
        if writer.size < total:
            return False
        self.finish_blob(sha, owner)
        return True

    def drop_partial(self, sha: str, owner: str) -> bool:
        """Discard this user's unfinished upload of `sha` (to free quota); False when there was none."""
        return self._drop(self._partial(sha, owner))

    def drop_upload(self, upload_id: str, owner: str) -> bool:
        """Discard this user's unfinished unnamed upload `upload_id`; False when there was none."""
        return self._drop(self._upload_partial(upload_id, owner))

    def _drop(self, path: Path) -> bool:
        if path in self._writers:
            raise UploadBusy("this upload is in progress on another connection: wait for it to end")
        self._drop_hashing(path)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def sweep_partials(self, max_age_s: float) -> int:
        """Delete partial uploads untouched for `max_age_s` (a client or worker that never came back), and the
        folders they leave empty; returns how many files went."""
        cutoff, removed = time.time() - max_age_s, 0
        for group in list((self.root / "partial").iterdir()):
            paths = [group] if group.is_file() else list(group.iterdir())  # files: the layout before groups
            for path in paths:
                try:
                    if path not in self._writers and path.stat().st_mtime < cutoff:
                        path.unlink()
                        self._drop_hashing(path)
                        removed += 1
                except OSError:
                    pass
            if group.is_dir() and group.name.startswith("job~"):
                try:
                    group.rmdir()  # only when empty
                except OSError:
                    pass
        return removed

    # -- artifacts ----------------------------------------------------------------------------------
    def artifact_path(self, job_id: str, name: str) -> Path:
        return self.root / "artifacts" / job_id / check_artifact_name(name)

    def open_artifact_chunk(self, job_id: str, name: str, offset: int, expect: int, total: int) -> PartialWriter:
        """Chunks of an artifact upload; offset 0 starts it over (a new checkpoint under the same name)."""
        path = self.artifact_partial(job_id, name)
        return self.open_partial(path, f"job~{job_id}", offset, expect, total, restart=True)

    def finish_artifact(self, job_id: str, name: str) -> tuple[int, str]:
        """Hash the complete artifact upload and move it into place (blocking: run it off the event loop)."""
        part = self.artifact_partial(job_id, name)
        if not part.is_file():
            raise BlobError(f"the upload of '{name}' is gone (a newer upload of it started over): upload it again")
        size, sha = part.stat().st_size, self.digest(part)
        path = self.artifact_path(job_id, name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, path)
        except (NotADirectoryError, IsADirectoryError, FileExistsError):  # another upload took the name's path
            part.unlink(missing_ok=True)
            raise BlobError(
                f"'{name}' collides with another artifact of job {job_id} (a file where a folder is needed, or a "
                "folder where the file would go): upload it under another name"
            ) from None
        return size, sha

    def write_artifact(self, job_id: str, name: str, data: bytes) -> tuple[int, str]:
        """A small artifact the backend makes itself (history.json), written whole."""
        path = self.artifact_path(job_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return len(data), hashlib.sha256(data).hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
