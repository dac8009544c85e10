"""Content-addressed bytes in S3 cannot be poisoned (issue 24 item 4), against moto's server: two publishes of one
content name race, one for the real bytes and one whose upload is swapped for other bytes while it is being
published; whatever happens, `blobs/<sha>` holds the bytes that hash to `<sha>` or nothing, fifty times over."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # noqa: F401  (the test extra has it: missing fails, never skips)
import pytest
import requests
from aws_moto import make_account, moto_server

from aibro_backend.storage import claims
from aibro_backend.storage.s3blobs import S3Backing, S3BlobError
from aibro_backend.storage.store import Store

ROUNDS = 50


@pytest.fixture(scope="module")
def backing() -> Iterator[S3Backing]:
    with moto_server():
        account = make_account()
        s3 = S3Backing(account["session"], account["bucket"], "race/", "us-east-1")
        yield s3
        s3.close()


def _put(backing: S3Backing, user: int, sha: str, body: bytes) -> None:
    plan = backing.plan_upload(backing.upload_key(user, sha[:32]), len(body), None)
    part = plan["parts"][0]
    requests.put(part["url"], data=body, headers=part["headers"], timeout=30).raise_for_status()


def test_racing_finishes_never_leave_other_bytes_under_a_name(backing: S3Backing) -> None:
    poisoned = [n for n in range(ROUNDS) if not _race(backing, n)]
    assert not poisoned, f"blobs/<sha> held other bytes after rounds {poisoned} of {ROUNDS}"


def _race(backing: S3Backing, n: int) -> bool:
    """One round: a publish of the real bytes, and meanwhile a second upload of other bytes to the same key and
    its own publish. True when blobs/<sha> then holds the real bytes or nothing."""
    real = f"round {n}: the real bytes ".encode() * 100
    sha = hashlib.sha256(real).hexdigest()
    _put(backing, 7, sha, real)
    started = threading.Event()
    unexpected: list[BaseException] = []

    def finish() -> None:
        started.set()
        refused_or_done(lambda: backing.publish(backing.upload_key(7, sha[:32]), sha), unexpected)

    def swap() -> None:
        started.wait(5)
        _put(backing, 7, sha, b"X" * len(real))  # the same user's second upload of the name, with other bytes
        refused_or_done(lambda: backing.publish(backing.upload_key(7, sha[:32]), sha), unexpected)

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
    assert backing.publish(backing.upload_key(8, sha[:32]), sha) == len(real)
    assert hashlib.sha256(_get(backing, backing.blob_key(sha)) or b"").hexdigest() == sha


def test_upkeep_proves_a_claim_left_unpublished_and_deletes_upload_keys_when_due(
    backing: S3Backing, tmp_path: Path
) -> None:
    """A claim the backend could not publish (S3 away, a restart between finish and publish) is published by the
    next upkeep; the upload key its user read stays until due, then goes; a false claim leaves the index."""
    store = Store(tmp_path / "aibro.db")
    uid = store.users.ensure("ann")
    real, fake = b"claimed and true " * 64, b"claimed but false " * 64
    true_sha, false_sha = hashlib.sha256(real).hexdigest(), hashlib.sha256(b"something else").hexdigest()
    for sha, body in ((true_sha, real), (false_sha, fake)):
        _put(backing, uid, sha, body)
        store.blobs.add(sha, uid, len(body), backing.upload_key(uid, sha[:32]))

    assert asyncio.run(claims.upkeep(store, backing)) == {"published": 1, "deleted": 0}
    assert store.blobs.s3_key(true_sha, uid) is None and store.blobs.size(true_sha, uid) == len(real)
    assert backing.verified_size(true_sha) == len(real)
    assert store.blobs.size(false_sha, uid) is None and backing.verified_size(false_sha) is None
    assert store.users.counters(uid) == {"blob_claims_refused": 1}
    keys = [backing.upload_key(uid, sha[:32]) for sha in (true_sha, false_sha)]
    assert all(_get(backing, k) is not None for k in keys), "a worker may still be reading them"
    for key in keys:
        store.blobs.doom_s3_key(key, 0.0)  # as when the URL lifetime has passed
    assert asyncio.run(claims.upkeep(store, backing)) == {"published": 0, "deleted": 2}
    assert all(_get(backing, k) is None for k in keys)
    store.close()


def refused_or_done(finish: Any, unexpected: list[BaseException]) -> None:
    """A racing publish may succeed or be refused (S3BlobError, which the API answers 4xx); nothing else."""
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
