"""Uploads that go to S3 instead of the backend: the client's blobs and the worker's artifacts share this code.

The backend answers `start` with a plan (presigned PUT URLs: one, or one per multipart part), the bytes go
straight to S3, PARALLEL_PARTS parts at a time (a single connection to S3 rarely fills the link: each PUT waits on
its own round trips), and `finish` hands the parts' ETags back for the backend to complete, verify and index. A
part is read where it is (`read` may answer a memoryview of an array's buffer), so memory in flight is at most
PARALLEL_PARTS parts. The presigned requests carry no bearer token: the URL is the permission.

S3 has bad minutes (500, 503 SlowDown, dropped connections): a part is sent again, and `start` and `finish` asked
again when the backend answers that its bucket is not answering (503), with jittered backoff for up to S3_RETRY_S
each; only then does the upload fail, saying so. `broke_off` is the same judgement for a download (which a backend
keeping bytes in S3 redirects there).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from .backoff import S3_PART, retry
from .errors import ApiError, BackendUnreachable
from .files import sha256_file
from .transport import Transport

S3_RETRY_S = 120.0  # how long one part, or the backend's start or finish, is tried again while S3 fails
PUT_TIMEOUT_S = 300
PARALLEL_PARTS = 4


class ViewBody:
    """Bytes (or a memoryview of them) as a request body without a copy: requests sends a file-like object with a
    length as is, reading it block by block. One per request: a retry needs a fresh one."""

    def __init__(self, view: bytes | memoryview) -> None:
        self.view, self.pos = memoryview(view), 0

    def __len__(self) -> int:
        return len(self.view) - self.pos

    def read(self, n: int = -1) -> memoryview:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out, self.pos = self.view[self.pos : end], end
        return out


def upload_via_s3(
    t: Transport, path: str, size: int, read: Callable[[int, int], bytes | memoryview], sha: str | None, **extra: Any
) -> dict[str, Any]:
    """Upload `size` bytes (`read(offset, length)`) through the plan the backend answers at POST `path`; returns
    the backend's `finish` answer. `extra` (a worker's `attempt`) goes with both requests. Without `sha`, the
    bytes are hashed on a thread of their own while the parts go, and `finish` names them by that digest."""
    body: dict[str, Any] = {"size": size, **extra}
    if sha:
        body["sha256"] = sha
    plan = _asked(t, path, {"action": "start", **body})
    along = None if sha else HashAlong(size, read)
    local = threading.local()

    def put(part: dict[str, Any]) -> dict[str, Any]:
        if not hasattr(local, "s3"):
            local.s3 = requests.Session()  # a session per thread: requests' sessions are not thread-safe
        etag = _put(local.s3, part, read(int(part["offset"]), int(part["size"])))
        return {"number": int(part["number"]), "etag": etag}

    parts = plan["parts"]
    if len(parts) == 1:
        done = [put(parts[0])]
    else:
        with ThreadPoolExecutor(min(PARALLEL_PARTS, len(parts)), thread_name_prefix="aibro-s3-part") as pool:
            done = list(pool.map(put, parts))
    if along is not None:
        body["sha256"] = along.digest()
    finish = {"action": "finish", **body, "upload_id": plan.get("upload_id")}
    if plan.get("upload_id"):
        finish["parts"] = done
    return _asked(t, path, finish)


def _asked(t: Transport, path: str, body: dict[str, Any]) -> Any:
    """POST `body` to the backend, again while it answers that its S3 bucket is not answering (503)."""
    return retry(lambda: t.json("POST", path, json=body), retry_on=_bucket_down, within_s=S3_RETRY_S, backoff=S3_PART)


def _bucket_down(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status == 503


class HashAlong:
    """SHA-256 of `size` bytes read in order on a thread of its own (hashlib lets go of the GIL), so naming bytes
    costs no time beside sending them in parallel parts."""

    BLOCK = 8 << 20

    def __init__(self, size: int, read: Callable[[int, int], bytes | memoryview]) -> None:
        self.size, self.read = size, read
        self.h = hashlib.sha256()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="aibro-hash-along", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for offset in range(0, self.size, self.BLOCK):
                self.h.update(self.read(offset, min(self.BLOCK, self.size - offset)))
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by digest()
            self.failed = exc

    def digest(self) -> str:
        self.thread.join()
        if self.failed is not None:
            raise self.failed
        return self.h.hexdigest()


def _put(s3: requests.Session, part: dict[str, Any], data: bytes | memoryview) -> str:
    """PUT one part, again after a broken connection or a 5xx (S3's 'slow down' included); returns its ETag."""

    def once() -> str:
        try:
            body = ViewBody(data) if len(data) else b""
            resp = s3.put(part["url"], data=body, headers=part.get("headers") or {}, timeout=PUT_TIMEOUT_S)
        except requests.RequestException as exc:
            raise BackendUnreachable(f"S3 did not take part {part['number']} ({exc}): try again") from None
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, f"S3 refused part {part['number']}: {resp.text[:300]}")
        return resp.headers.get("ETag") or "-"

    return retry(once, retry_on=again_later, within_s=S3_RETRY_S, backoff=S3_PART)


def again_later(exc: BaseException) -> bool:
    """A part's failure worth another try in a moment: S3 out of reach (`_put` says BackendUnreachable), or what
    `broke_off` says."""
    return isinstance(exc, BackendUnreachable) or broke_off(exc)


def broke_off(exc: BaseException) -> bool:
    """A download's failure worth starting it again: a connection that broke or timed out (halfway through the
    body too), or a 5xx (S3's SlowDown and InternalError after the backend's redirect, a backend whose bucket is not
    answering). A backend out of reach is not one: its callers wait for it their own way."""
    return isinstance(exc, requests.RequestException) or (isinstance(exc, ApiError) and exc.status >= 500)


def upload_file_via_s3(t: Transport, path: str, source: Path, **extra: Any) -> dict[str, Any]:
    """A file through `upload_via_s3`, its sha256 sent along (S3 checks a single PUT against it)."""
    sha = sha256_file(source)
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return upload_via_s3(t, path, size, read, sha, **extra)
