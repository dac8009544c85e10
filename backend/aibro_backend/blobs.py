"""Artifact and upload storage in a local directory: content-addressed blobs and per-job artifacts."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

SHA_RE = re.compile(r"[0-9a-f]{64}")
ARTIFACT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,7}")


class BlobError(ValueError):
    """A bad upload: wrong offset, digest mismatch or bad name."""


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


class BlobStore:
    """Blobs live at blobs/<sha>; partial uploads at partial/<user>-<sha>; artifacts at artifacts/<job>/<name>."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for sub in ("blobs", "partial", "artifacts"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / check_sha(sha)

    def has_blob(self, sha: str) -> bool:
        return self.blob_path(sha).exists()

    def _partial(self, sha: str, owner: str) -> Path:
        """Each user uploads into a partial file of their own, so nobody appends to or probes another's."""
        return self.root / "partial" / f"{owner}-{check_sha(sha)}"

    def received(self, sha: str, owner: str) -> int:
        """Bytes of this user's partial upload already here, so the client can resume where it stopped."""
        part = self._partial(sha, owner)
        return part.stat().st_size if part.exists() else 0

    def write_chunk(self, sha: str, owner: str, offset: int, data: bytes, total: int) -> bool:
        """Append one chunk at `offset`; return True when the whole upload is here and hashes to `sha`.

        A blob that already exists (another user sent the same bytes) is still received in full and
        verified: holding the digest alone never grants the content.
        """
        part = self._partial(sha, owner)
        have = part.stat().st_size if part.exists() else 0
        if offset != have:
            raise BlobError(f"chunk starts at byte {offset} but {have} bytes are stored: resume from {have}")
        if offset + len(data) > total:
            raise BlobError(f"chunk ends at byte {offset + len(data)}, past the declared total of {total}")
        with open(part, "ab") as f:
            f.write(data)
        if offset + len(data) < total:
            return False
        digest = sha256_file(part)
        if digest != sha:
            part.unlink()
            raise BlobError(f"upload digest {digest} does not match the name {sha}: upload it again from offset 0")
        if self.has_blob(sha):
            part.unlink()
        else:
            os.replace(part, self.blob_path(sha))
        return True

    def artifact_path(self, job_id: str, name: str) -> Path:
        return self.root / "artifacts" / job_id / check_artifact_name(name)

    def write_artifact(self, job_id: str, name: str, data: bytes) -> tuple[int, str]:
        path = self.artifact_path(job_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return len(data), hashlib.sha256(data).hexdigest()
