"""Content-addressed, chunked, resumable uploads; the blob store's checks; the store's gap-free event log."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from records import job_spec

from aibro_backend.storage.blobs import BlobError, BlobStore, UploadBusy, check_artifact_name, check_sha
from aibro_backend.storage.store import Store
from aibro_core.errors import ApiError
from aibro_jupyter import client as client_mod
from aibro_jupyter.client import BackendClient

pytestmark = pytest.mark.fast


def _put(client: BackendClient, sha: str, offset: int, total: int, data: bytes) -> dict[str, Any]:
    return client.t.json("PUT", f"/blobs/{sha}", params={"offset": offset, "total": total}, data=data)


def _head(client: BackendClient, sha: str) -> tuple[int, str | None]:
    resp = client.t.request("HEAD", f"/blobs/{sha}")
    return resp.status_code, resp.headers.get("X-Received")


def _received(client: BackendClient) -> int:
    return client.counters().get("blob_bytes_received", 0)


# -- over HTTP, against the real backend -----------------------------------------------------------------------
def test_unknown_blob(client: BackendClient) -> None:
    assert _head(client, hashlib.sha256(os.urandom(32)).hexdigest()) == (404, "0")


def test_chunked_upload_resumes_where_it_stopped(client: BackendClient) -> None:
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()
    before = _received(client)
    assert _head(client, sha) == (404, "0")
    assert _put(client, sha, 0, len(data), data[:100_000]) == {"complete": False, "received": 100_000}
    assert _head(client, sha) == (404, "100000")

    with pytest.raises(ApiError, match=r"starts at byte 200000 but 100000 bytes are stored: resume from 100000") as e:
        _put(client, sha, 200_000, len(data), data[200_000:])
    assert e.value.status == 409
    with pytest.raises(ApiError, match=r"resume from 100000") as e:
        _put(client, sha, 0, len(data), data[:100_000])  # a resend of what is there is refused too
    assert e.value.status == 409
    assert _head(client, sha) == (404, "100000")  # the refused chunks left nothing behind

    assert _put(client, sha, 100_000, len(data), data[100_000:200_000])["complete"] is False
    assert _head(client, sha) == (404, "200000")
    assert _put(client, sha, 200_000, len(data), data[200_000:]) == {"complete": True, "received": 300_000}
    resp = client.t.request("HEAD", f"/blobs/{sha}")
    assert resp.status_code == 200 and resp.headers["X-Blob-Size"] == "300000"
    assert _received(client) - before == 300_000


def test_client_resumes_a_partial_upload(client: BackendClient, tmp_path: Path) -> None:
    data = os.urandom(150_000)
    path = tmp_path / "half.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    _put(client, sha, 0, len(data), data[:60_000])
    assert client.upload_blob(path) == (sha, 90_000)  # only the rest is sent
    assert _head(client, sha)[0] == 200


def test_digest_mismatch_is_refused(client: BackendClient) -> None:
    data = os.urandom(1000)
    wrong = hashlib.sha256(b"something else" + os.urandom(16)).hexdigest()
    with pytest.raises(ApiError, match=r"upload digest [0-9a-f]{64} does not match the name .*upload it again") as e:
        _put(client, wrong, 0, len(data), data)
    assert e.value.status == 409
    assert _head(client, wrong) == (404, "0")  # the bad bytes are gone: a retry starts from 0


def test_chunk_past_the_declared_total_is_refused(client: BackendClient) -> None:
    data = os.urandom(100)
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(ApiError, match=r"past the declared total of 50") as e:
        _put(client, sha, 0, 50, data)
    assert e.value.status == 409


def test_bad_digest_and_bad_query(client: BackendClient) -> None:
    with pytest.raises(ApiError, match=r"'abc' is not a sha256 hex digest") as e:
        _put(client, "abc", 0, 1, b"x")
    assert e.value.status == 400
    sha = hashlib.sha256(b"x").hexdigest()
    with pytest.raises(ApiError, match=r"needs integer \?offset=&total=") as e:
        client.t.json("PUT", f"/blobs/{sha}", params={"offset": 0}, data=b"x")
    assert e.value.status == 400


def test_same_file_uploads_once(client: BackendClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "CHUNK", 64 * 1024)  # several chunks for a small file
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(200_000))
    before = _received(client)
    sha, sent = client.upload_blob(path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest() and sent == 200_000
    assert _received(client) - before == 200_000
    assert client.upload_blob(path) == (sha, 0)
    assert _received(client) - before == 200_000


def test_empty_file_uploads(client: BackendClient, tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    sha, _ = client.upload_blob(path)
    assert sha == hashlib.sha256(b"").hexdigest()
    resp = client.t.request("HEAD", f"/blobs/{sha}")
    assert resp.status_code == 200 and resp.headers["X-Blob-Size"] == "0"


# -- BlobStore and names, as units ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../x",
        "a/../b",
        "a/..",
        "/etc/passwd",
        "/abs",
        "a b",
        "a\\b",
        "a;b",
        "a\nb",
        "",
        "a//b",
        "a/",
        "x" * 200,
        ".hidden",
        "-rf",
        "é.txt",
        "a/b/c/d/e/f/g/h/i",
        "model.keras\n",
    ],
)
def test_artifact_names_are_validated(name: str) -> None:
    with pytest.raises(BlobError, match=r"is not allowed: use letters, digits"):
        check_artifact_name(name)


@pytest.mark.parametrize(
    "name",
    ["model.keras", "history.json", "checkpoints/epoch-0001.keras", "tensorboard/train/events.out.tfevents.1.x.v2"],
)
def test_artifact_names_accepted(name: str) -> None:
    assert check_artifact_name(name) == name


@pytest.mark.parametrize("sha", ["", "abc", "A" * 64, "g" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "a" * 64 + "\n"])
def test_bad_digests(sha: str) -> None:
    with pytest.raises(BlobError, match=r"not a sha256 hex digest"):
        check_sha(sha)


def test_blob_store_verifies_before_publishing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"hello world"
    sha = hashlib.sha256(data).hexdigest()
    assert store.write_chunk(sha, "u1", 0, data[:5], len(data)) is False and not store.has_blob(sha)
    assert store.received(sha, "u1") == 5
    with pytest.raises(BlobError, match="past the declared total"):
        store.write_chunk(sha, "u1", 5, data[5:] + b"!", len(data))
    with pytest.raises(BlobError, match="resume from 5"):
        store.write_chunk(sha, "u1", 3, data[3:], len(data))
    assert store.received(sha, "u1") == 5
    assert store.write_chunk(sha, "u1", 5, data[5:], len(data)) is True and store.has_blob(sha)
    assert store.blob_path(sha).read_bytes() == data and store.received(sha, "u1") == 0


def test_blob_store_drops_a_corrupt_upload(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    sha = hashlib.sha256(b"expected").hexdigest()
    with pytest.raises(BlobError, match="does not match"):
        store.write_chunk(sha, "u1", 0, b"tampered", 8)
    assert not store.has_blob(sha) and store.received(sha, "u1") == 0


def test_blob_store_artifacts_stay_inside_the_job(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    size, sha = store.write_artifact("job-1", "checkpoints/epoch-0001.keras", b"abc")
    assert (size, sha) == (3, hashlib.sha256(b"abc").hexdigest())
    assert store.artifact_path("job-1", "checkpoints/epoch-0001.keras").read_bytes() == b"abc"
    with pytest.raises(BlobError):
        store.write_artifact("job-1", "../job-2/model.keras", b"x")
    assert not (tmp_path / "artifacts" / "job-2").exists()


def test_an_artifact_being_finished_is_not_started_over_by_a_retry(tmp_path: Path) -> None:
    """A worker that gave up waiting for the answer to its last chunk sends it again while the backend hashes and
    moves the first: the retry waits (409 busy), and a finish that finds its upload gone says to upload again
    (it was a 500 with FileNotFoundError in the backend's log)."""
    store, job, name = BlobStore(tmp_path), "job-20261126-e24ec4d3", "checkpoints/epoch-0006.keras"
    writer = store.open_artifact_chunk(job, name, 0, 3, 3)
    writer.write(b"abc")
    writer.close()  # the handler keeps the writer registered until the finish is done
    with pytest.raises(UploadBusy):
        store.open_artifact_chunk(job, name, 0, 3, 3)
    assert store.finish_artifact(job, name) == (3, hashlib.sha256(b"abc").hexdigest())
    writer.release()
    with pytest.raises(BlobError, match=r"is gone.*upload it again"):
        store.finish_artifact(job, name)


# -- the store's event log, as a unit (the `store` fixture is in conftest.py) -------------------------------------
def page(store: Store, job_id: str, after: int = 0) -> list[dict[str, Any]]:
    return [json.loads(p) for p in store.events.parts(job_id, after)]


def user_page(store: Store, user_id: int, after: int = 0) -> list[dict[str, Any]]:
    return [json.loads(p) for p in store.events.user_parts(user_id, after)[0]]


def test_event_seq_is_gap_free_per_job(store: Store) -> None:
    uid = store.users.ensure("u")
    spec = job_spec()
    store.jobs.create("job-a", uid, spec)
    store.jobs.create("job-b", uid, spec)
    for i in range(5):
        assert store.events.append("job-a", "log", {"message": f"a{i}"})["seq"] == i + 1
        assert store.events.append("job-b", "log", {"message": f"b{i}"})["seq"] == i + 1
    assert [e["seq"] for e in page(store, "job-a")] == [1, 2, 3, 4, 5]
    assert [e["seq"] for e in page(store, "job-a", 3)] == [4, 5]
    with pytest.raises(KeyError):
        store.events.append("job-missing", "log", {})


def test_worker_duplicates_are_dropped(store: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, job_spec(fit={"epochs": 2}))
    assert store.events.append("job-a", "epoch", {"epoch": 0, "logs": {}}, attempt=0, wseq=1)["seq"] == 1
    assert store.events.append("job-a", "epoch", {"epoch": 0, "logs": {}}, attempt=0, wseq=1) is None  # resent
    assert store.events.append("job-a", "log", {"message": "retry"}, attempt=1, wseq=1)["seq"] == 2  # new attempt
    assert store.events.append("job-a", "log", {"message": "backend"})["seq"] == 3  # no wseq: never deduplicated
    assert store.events.append("job-a", "log", {"message": "backend"})["seq"] == 4
    assert [e["seq"] for e in page(store, "job-a")] == [1, 2, 3, 4]
    assert store.jobs.get("job-a").epochs_done == 1
    assert (
        store.events.max_wseq("job-a", 0),
        store.events.max_wseq("job-a", 1),
        store.events.max_wseq("job-a", 2),
    ) == (1, 1, 0)
    store.events.append("job-a", "status", {"status": "TRAINING", "substatus": "TRAINING"})
    assert (store.jobs.get("job-a").status, store.jobs.get("job-a").substatus) == ("TRAINING", "TRAINING")


def test_user_events_are_ordered_by_gid_and_scoped_to_the_user(store: Store) -> None:
    alice, bob = store.users.ensure("alice"), store.users.ensure("bob")
    assert store.users.ensure("alice") == alice
    spec = job_spec()
    store.jobs.create("job-a", alice, spec)
    store.jobs.create("job-b", alice, spec)
    store.jobs.create("job-c", bob, spec)
    for job in ("job-a", "job-b", "job-c", "job-b", "job-a"):
        store.events.append(job, "log", {"message": job})
    mine = user_page(store, alice)
    gids = [e["gid"] for e in mine]
    assert gids == sorted(gids) and len(set(gids)) == 4
    assert [e["job_id"] for e in mine] == ["job-a", "job-b", "job-b", "job-a"]
    assert [e["job_id"] for e in user_page(store, alice, gids[1])] == ["job-b", "job-a"]
    assert [e["job_id"] for e in user_page(store, bob)] == ["job-c"]


def test_tokens_are_stored_hashed(store: Store, tmp_path: Path) -> None:
    uid = store.users.ensure("u")
    token = store.tokens.new(uid)
    assert store.tokens.user_for(token) == {"id": uid, "name": "u"}
    assert store.tokens.user_for(token + "x") is None
    assert token.encode() not in (tmp_path / "db.sqlite").read_bytes() + _wal(tmp_path / "db.sqlite")


def _wal(db: Path) -> bytes:
    wal = db.with_name(db.name + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def test_byte_source_read_gives_any_range_across_the_npy_header_and_chunks() -> None:
    """A multipart upload reads its parts with ByteSource.read: every range equals the same slice of the bytes
    np.save writes, across the header/buffer boundary and chunk edges, and short at the end."""
    import io

    import numpy as np

    from aibro_jupyter.blobsource import ArraySource, BytesSource

    arr = np.arange(30_000, dtype=np.float32).reshape(100, 300)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    whole = buf.getvalue()
    source = ArraySource(arr)
    assert source.size == len(whole)
    for start, length in ((0, 10), (0, 200), (100, 50), (127, 4096), (5000, 70_000), (len(whole) - 7, 100)):
        assert source.read(start, length) == whole[start : start + length], (start, length)
    data = BytesSource(b"abcdef")
    assert data.read(2, 3) == b"cde" and data.read(4, 10) == b"ef"
