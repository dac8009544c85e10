"""Bytes in and out: user blob uploads and artifact downloads, worker blob downloads and artifact uploads.

Every transfer streams. An upload (`PUT`) is decided from its headers in `prepare()` (token, Content-Length,
offset, quota) and its body is appended to a partial file as it arrives (`@stream_request_body`); a finished
upload is hashed off the event loop and moved into place. A download is written 1 MiB at a time, each piece
flushed to the socket before the next is read, so the backend holds about one piece per connection however large
the file is. Uploads are chunked and resumable: `?offset=&total=`, and HEAD says how much is already here.

When the blob store has its S3 backing (the AWS provider on), the same routes answer "go here instead": HEAD on a
blob the user lacks says `X-Upload-Via: s3`, `POST .../upload` (`S3Upload`) hands out presigned PUT URLs and
finishes the upload, downloads answer 307 to a presigned GET, and the chunked PUTs are refused with that fix. The
backend then signs, verifies and indexes, and no training byte passes through it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tornado.web
from tornado.ioloop import IOLoop
from tornado.iostream import StreamClosedError

from aibro_core import vocabulary as v
from aibro_core.models import ENV_KEY_PATTERN, NameUpload, S3Upload

from ..providers import shipping
from ..server.state import Backend
from ..storage import claims
from ..storage.blobs import (
    BlobError,
    PartialWriter,
    UploadBusy,
    artifact_conflict,
    check_artifact_name,
    check_sha,
    check_upload_id,
)
from ..storage.s3blobs import S3Backing, S3BlobError, transient
from .base import ApiError, BaseHandler, UserHandler, bearer_of
from .worker import WorkerHandler

log = logging.getLogger("aibro.backend")
READ_CHUNK = 1024 * 1024
VIA_S3 = "X-Upload-Via"  # HEAD's header when uploads go to S3 on presigned URLs (POST .../upload)


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
    the route's limit, which server/guard.py enforces from the headers, before any of it is read)."""

    BODY_LIMIT = "chunk_max_body"  # the Limits field server/guard.py checks Content-Length against
    USAGE = "this route needs whole numbers"
    writer: PartialWriter | None = None
    refusal: ApiError | None = None
    failure: Exception | None = None
    discard: bool = False
    finishing: bool = False

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
        self._append(lambda writer: writer.write(chunk))

    def body_buffer(self) -> memoryview | None:
        """The writer's next buffer, which the connection reads into (server/bodyinto.py); None once refused."""
        if self.writer is None or self.failure is not None:
            return None
        return self.writer.buffer()

    def body_filled(self, buf: memoryview, n: int) -> None:
        self._append(lambda writer: writer.filled(buf, n))

    def _append(self, write: Callable[[PartialWriter], None]) -> None:
        if self.writer is None or self.failure is not None:
            return  # refused, or already held: the body is read and dropped
        try:
            write(self.writer)
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

    async def finish_upload(self, fn: Any, *args: Any) -> Any:
        """Run the blocking finish (hash, move into place) off the event loop, the partial file still this
        request's: a retry of the same upload that arrives meanwhile (its client gave up waiting) is told to wait,
        instead of starting the file over under the finish."""
        self.finishing = True
        try:
            return await IOLoop.current().run_in_executor(None, fn, *args)
        except BlobError as exc:
            raise ApiError(409, str(exc)) from None
        finally:
            self.finishing = False
            self._release()

    def on_finish(self) -> None:
        self._release()

    def on_connection_close(self) -> None:
        if not self.finishing:
            self._release()  # what arrived stays in the partial file: the client resumes from there
        super().on_connection_close()

    def _release(self) -> None:
        if self.writer is not None:
            self.writer.release()
            self.writer = None


@tornado.web.stream_request_body
class BlobHandler(StreamedUpload, UserHandler):
    USAGE = "PUT /blobs/{sha} needs integer ?offset=&total= query arguments"

    async def head(self, sha: str) -> None:
        check = _sha(sha)
        size = self.backend.store.blobs.size(check, self.uid)
        s3 = self.backend.blobs.s3
        if s3 is not None:  # held = indexed for this user and in the bucket: their own upload, or the proven copy
            own = self.backend.store.blobs.s3_key(check, self.uid)
            if size is not None and await _run(s3, s3.size if own else s3.verified_size, own or check) is None:
                size = None
            self.set_header(VIA_S3, "s3")
        if size is not None:
            self.backend.store.blobs.touch(self.uid, [check])  # about to be used: the last to make room
            self.set_header("X-Blob-Size", str(size))
            self.set_status(200)
        else:
            self.set_header("X-Received", str(self.backend.blobs.received(check, str(self.uid))))
            self.set_header("X-Chunk-Max", str(self.backend.limits.chunk_max_body))
            self.set_status(404)
        self.finish()

    def start_put(self, sha: str) -> None:
        check = _sha(sha)
        _refuse_in_s3(self, f"/blobs/{check}/upload")
        offset, total = self.int_arg("offset", 0), self.int_arg("total", None)
        length = self.body_length()
        _check_size(self, total, "a blob")
        if self.backend.store.blobs.size(check, self.uid) is not None:
            self.discard = True  # this user holds it already: nothing to store
            return
        _check_partial_quota(self, length, new=not self.backend.blobs.has_partial(check, str(self.uid)))
        if offset == 0:
            _check_stored_room(self, total)
        self.open_writer(self.backend.blobs.open_blob_chunk, check, str(self.uid), offset, length, total)

    async def put(self, sha: str) -> None:
        if self.discard and self.refusal is None:
            total = self.backend.store.blobs.size(sha, self.uid)
            self.send({"complete": True, "received": total})
            return
        writer = self.finished_writer()
        store = self.backend.store
        store.users.bump(self.uid, "blob_bytes_received", writer.written)
        if writer.size < writer.total:
            self.send({"complete": False, "received": writer.size})
            return
        await self.finish_upload(self.backend.blobs.finish_blob, sha, str(self.uid))
        _keep(self, sha, writer.total)
        self.send({"complete": True, "received": writer.total})

    def delete(self, sha: str) -> None:
        """Drop this user's unfinished upload of `sha` (the quota counts it until then); complete blobs stay."""
        try:
            dropped = self.backend.blobs.drop_partial(_sha(sha), str(self.uid))
        except UploadBusy as exc:
            raise ApiError(409, str(exc)) from None
        self.send({"dropped": dropped})


@tornado.web.stream_request_body
class UnnamedUploadHandler(StreamedUpload, UserHandler):
    """/blobs/uploads/{id}: a blob uploaded in one pass and named at the end. The client picks the id, PUTs chunks
    (`?offset=&total=`, resumable: HEAD says X-Received), then POSTs `{size}` to `.../finish`, and the blob is
    named by the digest the backend kept of the bytes as they arrived (the client reads its buffer once and hashes
    nothing). Nothing is deduplicated before the bytes move: the client takes this way only for data it has not
    sent before (see aibro_jupyter/hashcache.py)."""

    USAGE = "PUT /blobs/uploads/{id} needs integer ?offset=&total= query arguments"

    def head(self, upload_id: str) -> None:
        check = _upload_id(upload_id)
        if self.backend.blobs.s3 is not None:
            self.set_header(VIA_S3, "s3")
        self.set_header("X-Received", str(self.backend.blobs.upload_received(check, str(self.uid))))
        self.set_header("X-Chunk-Max", str(self.backend.limits.chunk_max_body))
        self.finish()

    def start_put(self, upload_id: str) -> None:
        check = _upload_id(upload_id)
        _refuse_in_s3(self, "/blobs/{sha256}/upload")
        offset, total = self.int_arg("offset", 0), self.int_arg("total", None)
        length = self.body_length()
        if length == 0:
            raise ApiError(400, "a chunk of an unnamed upload carries at least one byte (send empty data by name)")
        _check_size(self, total, "a blob")
        _check_partial_quota(self, length, new=not self.backend.blobs.has_upload(check, str(self.uid)))
        if offset == 0:
            _check_stored_room(self, total)
        self.open_writer(self.backend.blobs.open_upload_chunk, check, str(self.uid), offset, length, total)

    async def put(self, upload_id: str) -> None:
        writer = self.finished_writer()
        self.backend.store.users.bump(self.uid, "blob_bytes_received", writer.written)
        self.send({"complete": writer.size >= writer.total, "received": writer.size})

    def delete(self, upload_id: str) -> None:
        try:
            dropped = self.backend.blobs.drop_upload(_upload_id(upload_id), str(self.uid))
        except UploadBusy as exc:
            raise ApiError(409, str(exc)) from None
        self.send({"dropped": dropped})


class UnnamedUploadFinish(UserHandler):
    """POST /blobs/uploads/{id}/finish `{size}`: the complete unnamed upload becomes a blob (UnnamedUploadHandler)."""

    async def post(self, upload_id: str) -> None:
        check = _upload_id(upload_id)
        body = self.body_model(NameUpload, "the upload's name")
        _check_size(self, body.size, "a blob")
        blobs = self.backend.blobs
        try:
            sha = await IOLoop.current().run_in_executor(
                None, blobs.finish_upload, check, str(self.uid), body.size, body.sha256
            )
        except BlobError as exc:
            raise ApiError(409, str(exc)) from None
        _keep(self, sha, body.size)
        self.send({"complete": True, "received": body.size, "sha256": sha})


class ArtifactHandler(UserHandler):
    async def get(self, job_id: str, name: str) -> None:
        self.own_job(job_id)
        await _send_artifact(
            self, job_id, name, f"job {job_id} has no artifact '{name}' (GET /jobs/{job_id}/artifacts lists them)"
        )


class WorkerBlobHandler(WorkerHandler):
    async def get(self, sha: str) -> None:
        inst = self.backend.store.instances.get(self.instance.id)
        job = self.backend.store.jobs.get(inst.job_id) if inst.job_id else None
        if job is None or job.spec is None or sha not in job.spec.blobs():
            raise ApiError(403, "this blob is not part of the job assigned to this instance")
        s3 = self.backend.blobs.s3
        if s3 is not None:  # the job's user's own upload until it is proven, then the shared copy
            key = self.backend.store.blobs.s3_key(sha, job.user_id) or s3.blob_key(sha)
            self.redirect(s3.get_url(key), status=307)
            return
        await send_file(self, self.backend.blobs.blob_path(sha))


class WorkerEnvHandler(WorkerHandler):
    """A requirements environment built by another machine of this instance's user: the newest job artifact
    `envs/<key>.zip` of that user's jobs (worker/envs.py uploads it after a build). Never another user's: a
    machine runs its user's code, so what it built is trusted by that user alone."""

    async def get(self, env_key: str) -> None:
        if not re.fullmatch(ENV_KEY_PATTERN, env_key):
            raise ApiError(400, f"an environment key is {ENV_KEY_PATTERN}, got {env_key[:80]!r}")
        name = env_artifact(env_key)
        job_id = self.backend.store.artifacts.newest(self.instance.user_id, name)
        if job_id is None:
            raise ApiError(404, f"no machine of this user has shared environment {env_key} yet: build it")
        await _send_artifact(self, job_id, name, f"environment {env_key} is no longer stored: build it")


def env_artifact(env_key: str) -> str:
    """The artifact name a shared environment is uploaded as (never reported to the user as a job's output)."""
    return f"envs/{env_key}.zip"


@tornado.web.stream_request_body
class WorkerArtifactHandler(StreamedUpload, WorkerHandler):
    """A worker's checkpoints and model: `PUT ?attempt=&offset=&total=` in chunks (offset 0 starts an upload over;
    no offset/total: the whole file in one body), `HEAD ?attempt=` says how much is here (X-Received)."""

    USAGE = "worker artifact uploads need integer ?attempt= (and ?offset=&total= for chunks)"

    async def get(self, job_id: str, name: str) -> None:
        _readable_by_assignment(self, job_id, name)
        await _send_artifact(self, job_id, name, f"no artifact {name}")

    def head(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id, self.int_arg("attempt", None))
        _artifact_path(self, job_id, name)
        if self.backend.blobs.s3 is not None:
            self.set_header(VIA_S3, "s3")
        self.set_header("X-Received", str(self.backend.blobs.artifact_received(job_id, name)))
        self.finish()

    def start_put(self, job_id: str, name: str) -> None:
        self.assigned_job(job_id, self.int_arg("attempt", None))
        _artifact_path(self, job_id, name)
        _refuse_in_s3(self, f"/worker/jobs/{job_id}/uploads/{name}")
        _check_name_free(self, job_id, name)
        length = self.body_length()
        offset = self.int_arg("offset", 0)
        total = self.int_arg("total", offset + length)
        max_job = self.backend.policy.max_job_bytes
        if total > max_job:
            raise ApiError(413, f"an artifact of {total} bytes is over the {max_job}-byte limit per job")
        limits = self.backend.limits
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
        size, sha = await self.finish_upload(blobs.finish_artifact, job_id, name)
        self.backend.store.artifacts.add(job_id, name, size, sha)
        self.send({"name": name, "size": size, "sha256": sha, "complete": True, "received": size})


class AgentHandler(BaseHandler):
    """The agent wheel (providers/shipping.py) to a machine this backend started: its enrollment token, unused
    and unexpired, or its worker token. The machine checks the SHA-256 its user data names before installing."""

    async def get(self) -> None:
        token = bearer_of(self.request.headers.get("Authorization"))
        store = self.backend.store
        if token is None or (store.instances.for_enroll(token) is None and store.instances.for_token(token) is None):
            raise ApiError(401, "the agent is served to this backend's machines: send their enrollment or worker token")
        wheel = shipping.served(self.backend.home)
        self.set_header("X-Agent-Version", wheel.version)
        self.set_header("X-Agent-Sha256", wheel.sha256)
        self.set_header("Content-Disposition", f'attachment; filename="{wheel.filename}"')
        await send_file(self, wheel.path)


class S3UploadHandler(UserHandler):
    """POST /blobs/uploads/{id}/upload (S3 backing only): `start` answers presigned URLs for this upload's own key
    (a single PUT signed with `sha256` when the client knows it, so S3 checks it); `finish` completes the upload
    and indexes it as this user's blob `sha256` (computed by the client over what it sent), read from that key
    until storage/claims.py has proven and shared it. The bytes cross the network once."""

    async def post(self, upload_id: str) -> None:
        check = _upload_id(upload_id)
        s3 = _s3(self, f"PUT /blobs/uploads/{check}?offset=&total=")
        body = self.body_model(S3Upload, "the upload request")
        _check_size(self, body.size, "a blob")
        key = s3.upload_key(self.uid, check)
        if body.action == "start":
            _check_stored_room(self, body.size)
            plan = await _run(s3, s3.plan_upload, key, body.size, body.sha256)
            claims.unfinished(self.backend.store, key, plan["upload_id"])
            self.send(plan)
            return
        if body.sha256 is None:
            raise ApiError(400, "finishing an upload to S3 needs 'sha256': the SHA-256 (hex) of the bytes sent")
        parts = [p.model_dump() for p in body.parts]
        size = await _run(s3, s3.complete, key, body.upload_id, parts)
        if size != body.size:  # the declared size is what the limits judged: nothing else is indexed as this user's
            raise ApiError(409, f"the upload holds {size} bytes, not the {body.size} declared: upload it again")
        store = self.backend.store
        store.blobs.forget_doomed(key)
        _keep(self, body.sha256, size, s3_key=key)
        store.users.bump(self.uid, "blob_bytes_s3", size)
        IOLoop.current().spawn_callback(claims.publish, store, s3, body.sha256, self.uid, key)
        self.send({"complete": True, "received": size, "sha256": body.sha256})


class WorkerUploadHandler(WorkerHandler):
    """POST /worker/jobs/{job}/uploads/{name} (S3 backing only): presigned URLs for the assigned job's artifact key
    `<prefix>/jobs/<job>/<name>` (a new upload replaces it, as offset 0 does on disk), then `finish` indexes it."""

    async def post(self, job_id: str, name: str) -> None:
        s3 = _s3(self, f"PUT /worker/jobs/{job_id}/artifacts/{name}?attempt=&offset=&total=")
        body = self.body_model(S3Upload, "the upload request")
        if body.attempt is None:
            raise ApiError(400, "worker uploads need 'attempt': the job attempt this worker runs")
        self.assigned_job(job_id, body.attempt)
        _artifact_path(self, job_id, name)
        _check_name_free(self, job_id, name)
        _check_size(self, body.size, "an artifact")
        key = s3.artifact_key(job_id, name)
        if body.action == "start":
            plan = await _run(s3, s3.plan_upload, key, body.size, body.sha256)
            claims.unfinished(self.backend.store, key, plan["upload_id"])
            self.send(plan)
            return
        if body.sha256 is None:
            raise ApiError(400, "finishing an artifact upload needs its 'sha256' (hex) to index it")
        size = await _run(s3, s3.complete, key, body.upload_id, [p.model_dump() for p in body.parts])
        if size != body.size:
            raise ApiError(409, f"S3 holds {size} bytes of {name}, not the {body.size} declared: upload it again")
        self.assigned_job(job_id, body.attempt)  # still this instance's, now that it is all there
        _check_name_free(self, job_id, name)  # and still free of another upload finished meanwhile
        with self.backend.store.transaction():
            self.backend.store.artifacts.add(job_id, name, size, body.sha256)
            self.backend.store.blobs.forget_doomed(key)
        self.send({"name": name, "size": size, "sha256": body.sha256, "complete": True, "received": size})


def _s3(handler: UserHandler | WorkerHandler, instead: str) -> S3Backing:
    s3 = handler.backend.blobs.s3
    if s3 is None:
        raise ApiError(409, f"this backend stores bytes itself, not in S3: upload with {instead}")
    return s3


def _refuse_in_s3(handler: UserHandler | WorkerHandler, instead: str) -> None:
    if handler.backend.blobs.s3 is not None:
        raise ApiError(
            409,
            f"this backend keeps bytes in S3: POST {instead} with {{action: start, size}} for presigned URLs "
            f"(HEAD answers {VIA_S3}: s3)",
        )


def quota(backend: Backend, uid: int) -> dict[str, int]:
    """What a user holds of the backend's storage and their limits (models.Quota, in /health)."""
    limits = backend.limits
    pending, uploads = backend.blobs.pending(str(uid))
    return {
        "stored_bytes": backend.store.blobs.stored_bytes(uid),
        "max_stored_bytes": limits.max_stored_bytes,
        "pending_bytes": pending,
        "max_pending_bytes": limits.max_partial_bytes,
        "pending_uploads": uploads,
        "max_pending_uploads": limits.max_partial_uploads,
    }


def _check_partial_quota(handler: UserHandler, length: int, new: bool) -> None:
    """429 when this chunk would pass the user's limit of unfinished bytes, or start an upload past their number."""
    limits = handler.backend.limits
    held, uploads = handler.backend.blobs.pending(str(handler.uid))
    if new and uploads >= limits.max_partial_uploads:
        raise ApiError(
            429,
            f"you hold {uploads} unfinished uploads, the limit of {limits.max_partial_uploads} per user: finish or "
            "resume one, drop one (DELETE /blobs/SHA, DELETE /blobs/uploads/ID), or wait until they expire "
            f"({limits.partial_ttl_s / 3600:g} h untouched)",
        )
    if held + length > limits.max_partial_bytes:
        raise ApiError(
            429,
            f"your unfinished uploads hold {held} bytes; this chunk of {length} would pass the limit of "
            f"{limits.max_partial_bytes} bytes per user: finish or resume those uploads first, drop one "
            f"(DELETE /blobs/SHA), or wait until they expire ({limits.partial_ttl_s / 3600:g} h untouched)",
        )


def _check_name_free(handler: WorkerHandler, job_id: str, name: str) -> None:
    """A name the job's stored artifacts leave free: 'a/b' beside a file 'a' (or 'a' beside 'a/b') has no place."""
    why = artifact_conflict((a["name"] for a in handler.backend.store.artifacts.of_job(job_id)), name)
    if why is not None:
        raise ApiError(409, f"{why}: upload it under another name")


def _pinned(handler: UserHandler) -> dict[str, int]:
    """The user's blobs that their active jobs read, with their sizes: they stay while those jobs run."""
    store = handler.backend.store
    shas = {
        sha for job in store.jobs.list(handler.uid, v.JOB_ACTIVE) if job.spec is not None for sha in job.spec.blobs()
    }
    return {sha: store.blobs.size(sha, handler.uid) or 0 for sha in shas}


def _check_stored_room(handler: UserHandler, size: int) -> dict[str, int]:
    """413 unless a blob of `size` bytes fits the user's stored-bytes limit beside what their active jobs read
    (everything else can make room); returns those jobs' blobs."""
    limit = handler.backend.limits.max_stored_bytes
    if size > limit:
        raise ApiError(
            413,
            f"a blob of {size} bytes is over your limit of {limit} bytes of stored blobs: send less data, or ask "
            "the backend's admin to raise AIBRO_MAX_STORED_BYTES",
        )
    pinned = _pinned(handler)
    busy = sum(pinned.values())
    if busy + size > limit:
        raise ApiError(
            413,
            f"your active jobs read {busy} bytes of blobs: with this one of {size} bytes you would hold more than "
            f"your limit of {limit} bytes of stored blobs. Wait for one of them to end or cancel it "
            "(`aibro cancel JOB`), then upload again",
        )
    return pinned


def _keep(handler: UserHandler, sha: str, size: int, s3_key: str | None = None) -> None:
    """Index a finished blob as the user's (`s3_key`: their own S3 upload of it, not yet proven), first dropping
    their least recently used blobs that no active job reads until it fits their stored-bytes limit (on the event
    loop, with no await in between, so uploads finishing together cannot pass it). A blob nobody holds any more
    loses its bytes."""
    backend = handler.backend
    store, blobs = backend.store, backend.blobs
    if store.blobs.size(sha, handler.uid) is not None:
        if s3_key is not None:  # sent again (the copy they read had gone): this upload is the one to read
            claims.replace(store, sha, handler.uid, s3_key)
        return
    try:
        pinned = _check_stored_room(handler, size)
    except ApiError:
        if blobs.s3 is None and not store.blobs.held(sha):
            blobs.remove_blob(sha)  # published by this upload for nobody
        raise
    over = store.blobs.stored_bytes(handler.uid) + size - backend.limits.max_stored_bytes
    dropped = 0
    for old, old_size in store.blobs.by_use(handler.uid):
        if over <= 0:
            break
        if old in pinned:
            continue
        if claims.drop(store, old, handler.uid) and blobs.s3 is None:
            blobs.remove_blob(old)
        over, dropped = over - old_size, dropped + 1
    if dropped:
        log.info("user %d: %d least recently used blobs dropped to make room for %s", handler.uid, dropped, sha)
    if blobs.s3 is None and not blobs.has_blob(sha):  # another user's upload dropped it between finish and now
        raise ApiError(409, f"blob {sha} went while this upload finished (nobody else held it): upload it again")
    store.blobs.add(sha, handler.uid, size, s3_key)


def _readable_by_assignment(handler: WorkerHandler, job_id: str, name: str) -> None:
    """A worker reads its assigned job's artifacts, and a study trial's worker also the model it starts from of the
    earlier trial it resumes (Hyperband's `tuner/trial_id`: that job's checkpoint at its best epoch, or its final
    model), when that job is of the same user."""
    inst = handler.backend.store.instances.get(handler.instance.id)
    assigned = handler.backend.store.jobs.get(inst.job_id) if inst.job_id else None
    trial = assigned.spec.trial if assigned and assigned.spec else None
    resume, epoch = (trial.resume_job or None, trial.resume_epoch) if trial else (None, None)
    start = "model.keras" if epoch is None else v.checkpoint_name(int(epoch))
    if resume == job_id and name == start:
        earlier = handler.backend.store.jobs.get(job_id)
        if earlier is not None and assigned is not None and earlier.user_id == assigned.user_id:
            return
    handler.assigned_job(job_id)


def _check_size(handler: UserHandler | WorkerHandler, size: int, what: str) -> None:
    max_job = handler.backend.policy.max_job_bytes
    if size > max_job:
        raise ApiError(413, f"{what} of {size} bytes is over the {max_job}-byte limit per job")


async def _run(s3: S3Backing, fn: Any, *args: Any) -> Any:
    """A blocking S3 call in the backing's pool, off the event loop; a refusal is a 409 naming the fix, S3 failing
    for now (past botocore's own retries) a 503 the client tries again on (aibro_core/presigned.py)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return await IOLoop.current().run_in_executor(s3.pool, fn, *args)
    except S3BlobError as exc:
        raise ApiError(409, str(exc)) from None
    except (BotoCoreError, ClientError) as exc:
        log.warning("S3 call %s failed: %s", getattr(fn, "__name__", fn), exc)
        if transient(exc):
            raise ApiError(503, f"the backend's S3 bucket is not answering now ({exc}): try again") from None
        raise ApiError(507, f"the backend could not reach its S3 bucket ({exc}): retry later") from None


async def _send_artifact(handler: UserHandler | WorkerHandler, job_id: str, name: str, missing: str) -> None:
    """An artifact's bytes: from disk, or a 307 to S3; a 404 saying `missing` when there are none."""
    path = _artifact_path(handler, job_id, name)
    if _redirect_to_s3(handler, job_id, name, path):
        return
    if not path.is_file():
        raise ApiError(404, missing)
    await send_file(handler, path)


def _redirect_to_s3(handler: UserHandler | WorkerHandler, job_id: str, name: str, path: Path) -> bool:
    """With the S3 backing, an indexed artifact the backend did not write itself is a 307 to a presigned GET."""
    s3 = handler.backend.blobs.s3
    if s3 is None or path.is_file():
        return False
    if not any(a["name"] == name for a in handler.backend.store.artifacts.of_job(job_id)):
        return False
    handler.redirect(s3.get_url(s3.artifact_key(job_id, name)), status=307)
    return True


def _sha(sha: str) -> str:
    try:
        return check_sha(sha)
    except BlobError as exc:
        raise ApiError(400, str(exc)) from None


def _upload_id(upload_id: str) -> str:
    try:
        return check_upload_id(upload_id)
    except BlobError as exc:
        raise ApiError(400, str(exc)) from None


def _artifact_path(handler: UserHandler | WorkerHandler, job_id: str, name: str) -> Path:
    try:
        return handler.backend.blobs.artifact_path(job_id, check_artifact_name(name))
    except BlobError as exc:
        raise ApiError(400, str(exc)) from None
