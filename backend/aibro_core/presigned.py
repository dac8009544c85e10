"""Uploads that go to S3 instead of the backend: the client's blobs and the worker's artifacts share this code.

The backend answers `start` with a plan (presigned PUT URLs: one, or one per multipart part), the bytes go
straight to S3, part by part, and `finish` hands the parts' ETags back for the backend to complete, verify and
index. The presigned requests carry no bearer token: the URL is the permission.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from .errors import ApiError, BackendUnreachable
from .transport import Transport

PUT_TRIES = 4
PUT_TIMEOUT_S = 300


def upload_via_s3(
    t: Transport, path: str, size: int, read: Callable[[int, int], bytes], sha: str | None, **extra: Any
) -> dict[str, Any]:
    """Upload `size` bytes (`read(offset, length)`) through the plan the backend answers at POST `path`; returns
    the backend's `finish` answer. `extra` (a worker's `attempt`) goes with both requests."""
    body: dict[str, Any] = {"size": size, **extra}
    if sha:
        body["sha256"] = sha
    plan = t.json("POST", path, json={"action": "start", **body})
    done = []
    with requests.Session() as s3:
        for part in plan["parts"]:
            etag = _put(s3, part, read(int(part["offset"]), int(part["size"])))
            done.append({"number": int(part["number"]), "etag": etag})
    finish = {"action": "finish", **body, "upload_id": plan.get("upload_id")}
    if plan.get("upload_id"):
        finish["parts"] = done
    return t.json("POST", path, json=finish)


def _put(s3: requests.Session, part: dict[str, Any], data: bytes) -> str:
    """PUT one part, again after a broken connection or a 5xx (S3's 'slow down' included); returns its ETag."""
    for attempt in range(PUT_TRIES):
        try:
            resp = s3.put(part["url"], data=data, headers=part.get("headers") or {}, timeout=PUT_TIMEOUT_S)
        except requests.RequestException as exc:
            if attempt == PUT_TRIES - 1:
                raise BackendUnreachable(f"S3 did not take part {part['number']} ({exc}): try again") from None
        else:
            if resp.status_code < 300:
                return resp.headers.get("ETag") or "-"
            if resp.status_code < 500 or attempt == PUT_TRIES - 1:
                raise ApiError(resp.status_code, f"S3 refused part {part['number']}: {resp.text[:300]}")
        time.sleep(min(4.0, 0.5 * 2**attempt))
    raise AssertionError("unreachable")


def upload_file_via_s3(t: Transport, path: str, source: Path, **extra: Any) -> dict[str, Any]:
    """A file through `upload_via_s3`, its sha256 sent along (S3 checks a single PUT against it)."""
    h = hashlib.sha256()
    with open(source, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        size = f.tell()

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return upload_via_s3(t, path, size, read, h.hexdigest(), **extra)
