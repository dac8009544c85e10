"""Bytes in and out: user blob uploads and artifact downloads, worker blob downloads and artifact uploads."""

from __future__ import annotations

from ..blobs import BlobError, check_artifact_name, check_sha
from .base import ApiError, UserHandler
from .jobspec import spec_blobs
from .worker import WorkerHandler


class BlobHandler(UserHandler):
    def head(self, sha: str) -> None:
        check = self._sha(sha)
        size = self.backend.store.blob_size(check, self.uid)
        if size is not None:
            self.set_header("X-Blob-Size", str(size))
            self.set_status(200)
        else:
            self.set_header("X-Received", str(self.backend.blobs.received(check, str(self.uid))))
            self.set_status(404)
        self.finish()

    def put(self, sha: str) -> None:
        check = self._sha(sha)
        try:
            offset = int(self.get_query_argument("offset", "0"))
            total = int(self.get_query_argument("total", ""))
        except (ValueError, TypeError):
            raise ApiError(400, "PUT /blobs/{sha} needs integer ?offset=&total= query arguments") from None
        if total > self.backend.policy.max_job_bytes:
            raise ApiError(413, f"a blob of {total} bytes is over the {self.backend.policy.max_job_bytes}-byte limit")
        body = self.request.body
        store = self.backend.store
        if store.blob_size(check, self.uid) is not None:
            self.send({"complete": True, "received": total})
            return
        try:
            done = self.backend.blobs.write_chunk(check, str(self.uid), offset, body, total)
        except BlobError as exc:
            raise ApiError(409, str(exc)) from None
        store.bump(self.uid, "blob_bytes_received", len(body))
        if done:
            store.add_blob(check, self.uid, total)
        self.send({"complete": done, "received": offset + len(body)})

    @staticmethod
    def _sha(sha: str) -> str:
        try:
            return check_sha(sha)
        except BlobError as exc:
            raise ApiError(400, str(exc)) from None


class ArtifactHandler(UserHandler):
    def get(self, job_id: str, name: str) -> None:
        self.own_job(job_id)
        try:
            path = self.backend.blobs.artifact_path(job_id, check_artifact_name(name))
        except BlobError as exc:
            raise ApiError(400, str(exc)) from None
        if not path.is_file():
            raise ApiError(404, f"job {job_id} has no artifact '{name}' (GET /jobs/{job_id}/artifacts lists them)")
        self.set_header("Content-Type", "application/octet-stream")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                self.write(chunk)
        self.finish()


class WorkerBlobHandler(WorkerHandler):
    def get(self, sha: str) -> None:
        inst = self.backend.store.instance(self.instance["id"])
        job = self.backend.store.job(inst["job_id"]) if inst["job_id"] else None
        if job is None or sha not in spec_blobs(job["spec"]):
            raise ApiError(403, "this blob is not part of the job assigned to this instance")
        self.set_header("Content-Type", "application/octet-stream")
        with open(self.backend.blobs.blob_path(sha), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                self.write(chunk)
        self.finish()


class WorkerArtifactHandler(WorkerHandler):
    def get(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id)
        path = self._path(job_id, name)
        if not path.is_file():
            raise ApiError(404, f"no artifact {name}")
        self.set_header("Content-Type", "application/octet-stream")
        self.finish(path.read_bytes())

    def put(self, job_id: str, name: str) -> None:
        attempt = int(self.get_query_argument("attempt", "-1"))
        self.assigned_job(job_id, attempt)
        self._path(job_id, name)
        size, sha = self.backend.blobs.write_artifact(job_id, name, self.request.body)
        self.backend.store.add_artifact(job_id, name, size, sha)
        self.send({"name": name, "size": size, "sha256": sha})

    def _path(self, job_id: str, name: str):  # noqa: ANN202
        try:
            return self.backend.blobs.artifact_path(job_id, check_artifact_name(name))
        except BlobError as exc:
            raise ApiError(400, str(exc)) from None
