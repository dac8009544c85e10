"""Artifact and upload storage in a local directory: content-addressed blobs and per-job artifacts.

Bytes go to disk as they arrive (`PartialWriter`), never through memory whole: a request body is appended to its
user's partial file chunk by chunk, and a finished upload is hashed from disk and renamed into place. Partial
uploads are bounded per user (`held`) and expire when left untouched (`sweep_partials`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .s3blobs import S3Backing

SHA_RE = re.compile(r"[0-9a-f]{64}")
ARTIFACT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,7}")
JOB_ID_RE = re.compile(r"[\w-]{1,128}")


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class PartialWriter:
    """Appends one request's body to a partial upload as it arrives: at most `expect` bytes (what the request
    declared), never past `total`. The partial file is this writer's alone until `release`."""

    def __init__(self, store: BlobStore, path: Path, group: str, expect: int, total: int) -> None:
        self.store, self.path, self.group, self.expect, self.total = store, path, group, expect, total
        self.f = open(path, "ab")  # noqa: SIM115 - held open across the request's body chunks
        self.size = self.f.tell()
        self.written = 0

    def write(self, data: bytes) -> None:
        if self.written + len(data) > self.expect or self.size + len(data) > self.total:
            raise BlobError("the body is longer than its Content-Length or runs past the declared total")
        self.f.write(data)
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

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / check_sha(sha)

    def has_blob(self, sha: str) -> bool:
        return self.blob_path(sha).exists()

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

    def received(self, sha: str, owner: str) -> int:
        """Bytes of this user's partial upload already here, so the client can resume where it stopped."""
        return _size(self._partial(sha, owner))

    def artifact_received(self, job_id: str, name: str) -> int:
        return _size(self.artifact_partial(job_id, name))

    def held(self, group: str) -> int:
        """Bytes a user (or a job, `job~<id>`) holds in unfinished uploads, counting what requests now in
        flight have declared but not yet sent: what the per-user quota bounds."""
        total = 0
        with os.scandir(self._group(group)) as it:
            for entry in it:
                try:
                    total += entry.stat().st_size
                except OSError:
                    pass
        return total + sum(w.expect - w.written for w in self._writers.values() if w.group == group)

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

    def finish_blob(self, sha: str, owner: str) -> None:
        """Hash the complete partial upload and move it into place (blocking: run it off the event loop).

        A blob that already exists (another user sent the same bytes) is still received in full and
        verified: holding the digest alone never grants the content.
        """
        part = self._partial(sha, owner)
        digest = sha256_file(part)
        if digest != sha:
            part.unlink()
            raise BlobError(f"upload digest {digest} does not match the name {sha}: upload it again from offset 0")
        if self.has_blob(sha):
            part.unlink()
        else:
            os.replace(part, self.blob_path(sha))

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
        path = self._partial(sha, owner)
        if path in self._writers:
            raise UploadBusy("this upload is in progress on another connection: wait for it to end")
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
        size, sha = part.stat().st_size, sha256_file(part)
        path = self.artifact_path(job_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, path)
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
