"""Bytes in and out: user blob uploads and artifact downloads, worker blob downloads and artifact uploads.

Every transfer streams. An upload (`PUT`) is decided from its headers in `prepare()` (token, Content-Length,
offset, quota) and its body is appended to a partial file as it arrives (`@stream_request_body`); a finished
upload is hashed off the event loop and moved into place. A download is written 1 MiB at a time, each piece
flushed to the socket before the next is read, so the backend holds about one piece per connection however large
the file is. Uploads are chunked and resumable: `?offset=&total=`, and HEAD says how much is already here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tornado.web
from tornado.ioloop import IOLoop
from tornado.iostream import StreamClosedError

from ..blobs import BlobError, PartialWriter, UploadBusy, check_artifact_name, check_sha
from ..limits import limits_of
from .base import ApiError, UserHandler
from .jobspec import spec_blobs
from .worker import WorkerHandler

READ_CHUNK = 1024 * 1024


async def send_file(handler: tornado.web.RequestHandler, path: Path) -> None:
    """Stream a file to the client, one flushed piece at a time (RequestHandler.write alone buffers it all)."""
    handler.set_header("Content-Type", "application/octet-stream")
    with open(path, "rb") as f:
        handler.set_header("Content-Length", str(f.seek(0, 2)))
        f.seek(0)
        try:
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                handler.write(chunk)
                await handler.flush()
        except StreamClosedError:
            return  # the client went away; tornado closes the request
    handler.finish()


class StreamedUpload(tornado.web.RequestHandler):
    """A PUT whose body goes to a PartialWriter as it arrives. `start_put` runs from the headers (after the
    handler's own auth in `prepare`) and opens `self.writer`; a refusal it raises is answered after the body
    was read and dropped, so the client sees the answer rather than a reset connection (the body is bounded by
    the route's limit, which app.py enforces from the headers, before any of it is read)."""

    BODY_LIMIT = "chunk_max_body"  # the Limits field app.py checks Content-Length against
    USAGE = "this route needs whole numbers"
    writer: PartialWriter | None = None
    refusal: ApiError | None = None
    failure: Exception | None = None
    discard: bool = False

    def prepare(self) -> None:
        super().prepare()  # the bearer token: UserHandler or WorkerHandler
        if self.request.method == "PUT":
            try:
                self.start_put(*self.path_args)
            except ApiError as exc:
                self.refusal = exc

    def start_put(self, *args: str) -> None:
        raise NotImplementedError

    def body_length(self) -> int:
        raw = self.request.headers.get("Content-Length")
        if raw is None or not raw.isdigit():
            raise ApiError(411, "send each chunk with a Content-Length header (no chunked transfer encoding)")
        return int(raw)

    def int_arg(self, name: str, default: int | None) -> int:
        raw = self.get_query_argument(name, None)
        if raw is None and default is not None:
            return default
        try:
            value = int(raw or "")
        except ValueError:
            value = -1
        if value < 0:
            got = "missing" if raw is None else f"{raw[:40]!r}"
            raise ApiError(400, f"{self.USAGE}: ?{name}= is {got}")
        return value

    def open_writer(self, opener: Any, *args: Any) -> None:
        try:
            self.writer = opener(*args)
        except UploadBusy as exc:
            raise ApiError(409, str(exc)) from None
        except BlobError as exc:
            raise ApiError(409, str(exc)) from None

    def data_received(self, chunk: bytes) -> None:
        if self.writer is None or self.failure is not None:
            return  # refused, or already held: the body is read and dropped
        try:
            self.writer.write(chunk)
        except (OSError, BlobError) as exc:
            self.failure = exc
            self.writer.close()

    def finished_writer(self) -> PartialWriter:
        """After the whole body arrived: the writer, closed, or the refusal or failure as an ApiError."""
        if self.refusal is not None:
            raise self.refusal
        writer = self.writer
        assert writer is not None
        writer.close()
        if self.failure is not None:
            raise ApiError(507, f"the backend could not store the upload ({self.failure}): retry later")
        return writer

    def on_finish(self) -> None:
        self._release()

    def on_connection_close(self) -> None:
        self._release()  # what arrived stays in the partial file: the client resumes from there
        super().on_connection_close()

    def _release(self) -> None:
        if self.writer is not None:
            self.writer.release()
            self.writer = None


@tornado.web.stream_request_body
class BlobHandler(StreamedUpload, UserHandler):
    USAGE = "PUT /blobs/{sha} needs integer ?offset=&total= query arguments"

    def head(self, sha: str) -> None:
        check = _sha(sha)
        size = self.backend.store.blob_size(check, self.uid)
        if size is not None:
            self.set_header("X-Blob-Size", str(size))
            self.set_status(200)
        else:
            self.set_header("X-Received", str(self.backend.blobs.received(check, str(self.uid))))
            self.set_status(404)
        self.finish()

    def start_put(self, sha: str) -> None:
        check = _sha(sha)
        offset, total = self.int_arg("offset", 0), self.int_arg("total", None)
        length = self.body_length()
        max_job = self.backend.policy.max_job_bytes
        if total > max_job:
            raise ApiError(413, f"a blob of {total} bytes is over the {max_job}-byte limit per job")
        if self.backend.store.blob_size(check, self.uid) is not None:
            self.discard = True  # this user holds it already: nothing to store
            return
        limits = limits_of(self.backend)
        held = self.backend.blobs.held(str(self.uid))
        if held + length > limits.max_partial_bytes:
            raise ApiError(
                429,
                f"your unfinished uploads hold {held} bytes; this chunk of {length} would pass the limit of "
                f"{limits.max_partial_bytes} bytes per user: finish or resume those uploads first, drop one "
                f"(DELETE /blobs/SHA), or wait until they expire ({limits.partial_ttl_s / 3600:g} h untouched)",
            )
        self.open_writer(self.backend.blobs.open_blob_chunk, check, str(self.uid), offset, length, total)

    async def put(self, sha: str) -> None:
        if self.discard and self.refusal is None:
            total = self.backend.store.blob_size(sha, self.uid)
            self.send({"complete": True, "received": total})
            return
        writer = self.finished_writer()
        store = self.backend.store
        store.bump(self.uid, "blob_bytes_received", writer.written)
        if writer.size < writer.total:
            self.send({"complete": False, "received": writer.size})
            return
        try:
            await IOLoop.current().run_in_executor(None, self.backend.blobs.finish_blob, sha, str(self.uid))
        except BlobError as exc:
            raise ApiError(409, str(exc)) from None
        store.add_blob(sha, self.uid, writer.total)
        self.send({"complete": True, "received": writer.total})

    def delete(self, sha: str) -> None:
        """Drop this user's unfinished upload of `sha` (the quota counts it until then); complete blobs stay."""
        try:
            dropped = self.backend.blobs.drop_partial(_sha(sha), str(self.uid))
        except UploadBusy as exc:
            raise ApiError(409, str(exc)) from None
        self.send({"dropped": dropped})


class ArtifactHandler(UserHandler):
    async def get(self, job_id: str, name: str) -> None:
        self.own_job(job_id)
        path = _artifact_path(self, job_id, name)
        if not path.is_file():
            raise ApiError(404, f"job {job_id} has no artifact '{name}' (GET /jobs/{job_id}/artifacts lists them)")
        await send_file(self, path)


class WorkerBlobHandler(WorkerHandler):
    async def get(self, sha: str) -> None:
        inst = self.backend.store.instance(self.instance["id"])
        job = self.backend.store.job(inst["job_id"]) if inst["job_id"] else None
        if job is None or sha not in spec_blobs(job["spec"]):
            raise ApiError(403, "this blob is not part of the job assigned to this instance")
        await send_file(self, self.backend.blobs.blob_path(sha))


@tornado.web.stream_request_body
class WorkerArtifactHandler(StreamedUpload, WorkerHandler):
    """A worker's checkpoints and model: `PUT ?attempt=&offset=&total=` in chunks (offset 0 starts an upload over;
    no offset/total: the whole file in one body), `HEAD ?attempt=` says how much is here (X-Received)."""

    USAGE = "worker artifact uploads need integer ?attempt= (and ?offset=&total= for chunks)"

    async def get(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id)
        path = _artifact_path(self, job_id, name)
        if not path.is_file():
            raise ApiError(404, f"no artifact {name}")
        await send_file(self, path)

    def head(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id, self.int_arg("attempt", None))
        _artifact_path(self, job_id, name)
        self.set_header("X-Received", str(self.backend.blobs.artifact_received(job_id, name)))
        self.finish()

    def start_put(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id, self.int_arg("attempt", None))
        _artifact_path(self, job_id, name)
        length = self.body_length()
        offset = self.int_arg("offset", 0)
        total = self.int_arg("total", offset + length)
        max_job = self.backend.policy.max_job_bytes
        if total > max_job:
            raise ApiError(413, f"an artifact of {total} bytes is over the {max_job}-byte limit per job")
        limits = limits_of(self.backend)
        held = self.backend.blobs.held(f"job~{job_id}")
        if held + length > limits.max_partial_bytes:
            raise ApiError(429, f"this job's unfinished artifact uploads hold {held} bytes: finish one first")
        self.open_writer(self.backend.blobs.open_artifact_chunk, job_id, name, offset, length, total)

    async def put(self, job_id: str, name: str) -> None:
        writer = self.finished_writer()
        if writer.size < writer.total:
            self.send({"complete": False, "received": writer.size})
            return
        self.assigned_job(job_id, self.int_arg("attempt", None))  # still this instance's, now that it is all here
        blobs = self.backend.blobs
        size, sha = await IOLoop.current().run_in_executor(None, blobs.finish_artifact, job_id, name)
        self.backend.store.add_artifact(job_id, name, size, sha)
        self.send({"name": name, "size": size, "sha256": sha, "complete": True, "received": size})


def _sha(sha: str) -> str:
    try:
        return check_sha(sha)
    except BlobError as exc:
        raise ApiError(400, str(exc)) from None


def _artifact_path(handler: UserHandler | WorkerHandler, job_id: str, name: str) -> Path:
    try:
        return handler.backend.blobs.artifact_path(job_id, check_artifact_name(name))
    except BlobError as exc:
        raise ApiError(400, str(exc)) from None
