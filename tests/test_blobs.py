"""Content-addressed, chunked, resumable uploads; the store's gap-free, duplicate-free event log."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from aibro_backend.blobs import BlobError, BlobStore, check_artifact_name
from aibro_backend.store import Store
from aibro_jupyter import client as client_mod
from aibro_jupyter.client import BackendClient
from aibro_jupyter.errors import ApiError


def _put(client: BackendClient, sha: str, offset: int, total: int, data: bytes) -> dict:
    return client.t.json("PUT", f"/blobs/{sha}", params={"offset": offset, "total": total}, data=data)


def test_chunked_upload_resumes_where_it_stopped(client: BackendClient) -> None:
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()
    head = client.t.request("HEAD", f"/blobs/{sha}")
    assert head.status_code == 404 and head.headers["X-Received"] == "0"
    assert _put(client, sha, 0, len(data), data[:100_000]) == {"complete": False, "received": 100_000}
    with pytest.raises(ApiError, match=r"starts at byte 200000 but 100000 bytes are stored: resume from 100000"):
        _put(client, sha, 200_000, len(data), data[200_000:])
    assert client.t.request("HEAD", f"/blobs/{sha}").headers["X-Received"] == "100000"
    assert _put(client, sha, 100_000, len(data), data[100_000:])["complete"] is True
    assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 200


def test_digest_mismatch_is_refused(client: BackendClient) -> None:
    data = os.urandom(1000)
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ApiError, match=r"does not match the name"):
        _put(client, wrong, 0, len(data), data)
    assert client.t.request("HEAD", f"/blobs/{wrong}").headers["X-Received"] == "0"


def test_same_file_uploads_once(client: BackendClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "CHUNK", 64 * 1024)  # several chunks for a small file
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(200_000))
    before = client.counters().get("blob_bytes_received", 0)
    sha, sent = client.upload_blob(path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest() and sent == 200_000
    assert client.counters()["blob_bytes_received"] - before == 200_000
    assert client.upload_blob(path) == (sha, 0)
    assert client.counters()["blob_bytes_received"] - before == 200_000


def test_bad_digest_in_url(client: BackendClient) -> None:
    with pytest.raises(ApiError, match=r"not a sha256 hex digest"):
        _put(client, "abc", 0, 1, b"x")


@pytest.mark.parametrize("name", ["../x", "a/../b", "/etc/passwd", "a b", "", "a//b", "x" * 200, ".hidden"])
def test_artifact_names_are_validated(name: str) -> None:
    with pytest.raises(BlobError):
        check_artifact_name(name)


def test_artifact_names_accepted() -> None:
    for name in ("model.keras", "checkpoints/epoch-0001.keras", "tensorboard/train/events.out.tfevents.1.x.v2"):
        assert check_artifact_name(name) == name


def test_blob_store_verifies_before_publishing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"hello world"
    sha = hashlib.sha256(data).hexdigest()
    assert store.write_chunk(sha, 0, data[:5], len(data)) is False and not store.has_blob(sha)
    assert store.received(sha) == 5
    with pytest.raises(BlobError, match="past the declared total"):
        store.write_chunk(sha, 5, data[5:] + b"!", len(data))
    assert store.write_chunk(sha, 5, data[5:], len(data)) is True and store.has_blob(sha)


def test_event_log_is_gap_free_and_deduplicated(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    uid = store.ensure_user("u")
    spec = {"machines": ["local-cpu"], "fit": {"epochs": 1}}
    store.create_job("job-a", uid, spec)
    store.create_job("job-b", uid, spec)
    assert store.append_event("job-a", "log", {"message": "1"})["seq"] == 1
    assert store.append_event("job-b", "log", {"message": "b1"})["seq"] == 1
    assert store.append_event("job-a", "epoch", {"epoch": 0, "logs": {}}, attempt=0, wseq=1)["seq"] == 2
    assert store.append_event("job-a", "epoch", {"epoch": 0, "logs": {}}, attempt=0, wseq=1) is None
    assert store.append_event("job-a", "log", {"message": "retry"}, attempt=1, wseq=1)["seq"] == 3
    assert [e["seq"] for e in store.events("job-a")] == [1, 2, 3]
    assert store.job("job-a")["epochs_done"] == 1
    assert store.max_wseq("job-a", 0) == 1
    gids = [e["gid"] for e in store.user_events(uid)]
    assert gids == sorted(gids) and len(gids) == 4
    store.append_event("job-a", "status", {"status": "TRAINING", "substatus": "TRAINING"})
    assert (store.job("job-a")["status"], store.job("job-a")["substatus"]) == ("TRAINING", "TRAINING")
    store.close()
