"""Content-addressed bytes in S3 cannot be poisoned (issue 24 item 4), against moto's server: two finishes of one
content name race, one for the real bytes and one whose staged object is swapped for other bytes while it is being
finished; whatever happens, `blobs/<sha>` holds the bytes that hash to `<sha>` or nothing, fifty times over."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import boto3  # noqa: F401  (the test extra has it: missing fails, never skips)
import pytest
import requests
from aws_moto import make_account, moto_server

from aibro_backend.storage.s3blobs import S3Backing, S3BlobError

ROUNDS = 50


@pytest.fixture(scope="module")
def backing() -> Iterator[S3Backing]:
    with moto_server():
        account = make_account()
        s3 = S3Backing(account["session"], account["bucket"], "race/", "us-east-1")
        yield s3
        s3.close()


def _put(backing: S3Backing, user: int, sha: str, body: bytes) -> None:
    plan = backing.plan_upload(backing.staging_key(user, sha), len(body), None)
    part = plan["parts"][0]
    requests.put(part["url"], data=body, headers=part["headers"], timeout=30).raise_for_status()


def test_racing_finishes_never_leave_other_bytes_under_a_name(backing: S3Backing) -> None:
    poisoned = [n for n in range(ROUNDS) if not _race(backing, n)]
    assert not poisoned, f"blobs/<sha> held other bytes after rounds {poisoned} of {ROUNDS}"


def _race(backing: S3Backing, n: int) -> bool:
    """One round: a finish of the real bytes, and meanwhile a second upload of other bytes under the same name and
    its own finish. True when blobs/<sha> then holds the real bytes or nothing."""
    real = f"round {n}: the real bytes ".encode() * 100
    sha = hashlib.sha256(real).hexdigest()
    _put(backing, 7, sha, real)
    started = threading.Event()
    unexpected: list[BaseException] = []

    def finish() -> None:
        started.set()
        refused_or_done(lambda: backing.finish_blob(7, sha, None, []), unexpected)

    def swap() -> None:
        started.wait(5)
        _put(backing, 7, sha, b"X" * len(real))  # the same user's second upload of the name, with other bytes
        refused_or_done(lambda: backing.finish_blob(7, sha, None, []), unexpected)

    threads = [threading.Thread(target=finish), threading.Thread(target=swap)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not unexpected, f"a finish failed otherwise than with a refusal: {unexpected!r}"
    body = _get(backing, backing.blob_key(sha))
    return body is None or hashlib.sha256(body).hexdigest() == sha


def test_a_second_user_with_the_real_bytes_repairs_a_name_that_fails_its_digest(backing: S3Backing) -> None:
    real = b"the real bytes, again " * 50
    sha = hashlib.sha256(real).hexdigest()
    backing.s3.put_object(Bucket=backing.bucket, Key=backing.blob_key(sha), Body=b"planted by hand")  # as if poisoned
    assert backing.verified_size(sha) is None  # a read that checks it quarantines it
    _put(backing, 8, sha, real)
    assert backing.finish_blob(8, sha, None, []) == len(real)
    assert hashlib.sha256(_get(backing, backing.blob_key(sha)) or b"").hexdigest() == sha


def refused_or_done(finish: Any, unexpected: list[BaseException]) -> None:
    """A racing finish may succeed or be refused (S3BlobError, which the API answers 4xx); nothing else."""
    try:
        finish()
    except S3BlobError:
        pass
    except BaseException as exc:  # noqa: BLE001 - collected, and failed on the test's thread
        unexpected.append(exc)


def _get(backing: S3Backing, key: str) -> bytes | None:
    try:
        return backing.s3.get_object(Bucket=backing.bucket, Key=key)["Body"].read()
    except backing.s3.exceptions.NoSuchKey:
        return None
