"""Arrays upload from their own buffers: new data in one pass that the backend names on the way in, a resubmit
decided without reading the bytes where they cannot have changed (a read-only memmap, a read-only array), and by a
fast fingerprint of every byte where they can (a writable array changed in place uploads again). Against a real
backend over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aibro_core.errors import ApiError
from aibro_jupyter import blobsource, config
from aibro_jupyter.blobsource import ArraySource
from aibro_jupyter.client import BackendClient
from aibro_jupyter.hashcache import CACHE
from aibro_jupyter.training import connect

from conftest import kill_workers
from helpers import aibro_cli

pytestmark = pytest.mark.fast

MIB = 1 << 20


@pytest.fixture(autouse=True)
def small_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays of 1 MiB and more take the one-pass way here (64 MiB by default) and keep a fingerprint (4 MiB), so
    tests stay small."""
    monkeypatch.setattr(blobsource, "ONE_PASS_MIN", MIB)
    monkeypatch.setattr(blobsource, "FINGERPRINT_MIN", MIB)


def _received(client: BackendClient) -> int:
    return client.counters().get("blob_bytes_received", 0)


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: ArraySource) -> str:
        raise AssertionError("the client hashed the whole array")

    monkeypatch.setattr(ArraySource, "sha256", refuse)


def _random(n: int, seed: int | None = None) -> np.ndarray:
    return np.random.default_rng(seed).random(n, dtype=np.float32)


def test_new_data_uploads_in_one_pass_named_by_the_backend(
    client: BackendClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _random(1_000_000)  # 4 MB, never seen
    expected = ArraySource(x).sha256()
    before = _received(client)
    with monkeypatch.context() as m:
        _no_hashing(m)  # one pass: the client reads the buffer once, to send it
        sha, sent = client.upload_array(x)
    assert sha == expected, "the backend's name is the SHA-256 of the .npy bytes"
    assert sent == ArraySource(x).size
    assert _received(client) - before == sent, "each byte crossed once"
    head = client.t.request("HEAD", f"/blobs/{sha}")
    assert head.status_code == 200 and head.headers["X-Blob-Size"] == str(sent)

    with monkeypatch.context() as m:
        _no_hashing(m)  # writable: recognised by its fingerprint (every byte, read at memory speed), no SHA-256 pass
        assert client.upload_array(x) == (sha, 0)
        assert client.upload_array(x.copy()) == (sha, 0), "the same bytes in another array"
    assert CACHE.known(x) is None, "a writable array is never taken at its word"


def test_a_writable_array_changed_in_place_uploads_again(client: BackendClient) -> None:
    x = _random(1_000_000)
    sha, _ = client.upload_array(x)
    x[600_000] += 1.0  # one value, in place
    new_sha, sent = client.upload_array(x)
    assert new_sha != sha and new_sha == ArraySource(x).sha256()
    assert sent == ArraySource(x).size


def test_a_read_only_memmap_resubmits_without_reading_its_bytes(
    client: BackendClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "features.npy"
    np.save(path, _random(600_000).reshape(1000, 600))
    first_sha, sent = client.upload_array(np.load(path, mmap_mode="r"))
    assert sent > 0 and first_sha == ArraySource(np.load(path)).sha256()

    with monkeypatch.context() as m:
        _no_hashing(m)
        assert client.upload_array(np.load(path, mmap_mode="r")) == (first_sha, 0), "a new mapping of the same file"
    view = np.load(path, mmap_mode="r")[100:200]  # a slice is its own blob: named from where it starts
    sha_view, sent_view = client.upload_array(view)  # 240 KB: small things are hashed first
    assert sent_view > 0
    with monkeypatch.context() as m:
        _no_hashing(m)
        assert client.upload_array(np.load(path, mmap_mode="r")[100:200]) == (sha_view, 0)
    assert sha_view == ArraySource(np.load(path)[100:200]).sha256()

    CACHE._loaded = False  # a restarted kernel: the file-backed names come back from AIBRO_HOME/hashes.json
    CACHE._files.clear()
    with monkeypatch.context() as m:
        _no_hashing(m)
        assert client.upload_array(np.load(path, mmap_mode="r")) == (first_sha, 0)

    np.save(path, _random(600_000).reshape(1000, 600))  # the file changes: new mtime, new name
    changed_sha, changed_sent = client.upload_array(np.load(path, mmap_mode="r"))
    assert changed_sha != first_sha and changed_sent > 0
    assert changed_sha == ArraySource(np.load(path)).sha256()


def test_a_read_only_array_is_known_while_it_lives(client: BackendClient, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _random(500_000)
    x.flags.writeable = False
    sha, sent = client.upload_array(x)
    assert sent > 0
    with monkeypatch.context() as m:
        _no_hashing(m)
        assert client.upload_array(x) == (sha, 0)
    assert CACHE.known(x[1:]) is None, "a view that starts elsewhere is other bytes"
    y = x.copy()  # writable again
    assert CACHE.known(y) is None


@pytest.fixture(scope="module")
def second_client(client: BackendClient, aibro_home: Path) -> BackendClient:
    made = aibro_cli(aibro_home, "backend", "add-user", "uploader2")
    assert made.returncode == 0, made.stderr[-2000:]
    return BackendClient(client.url, re.search(r"--token=(\S+)", made.stdout).group(1))


def test_the_backend_checks_a_name_it_is_given_and_keeps_uploads_per_user(
    client: BackendClient, second_client: BackendClient
) -> None:
    data = os.urandom(3 * MIB)
    upload = "0123456789abcdef0123456789abcdef"
    path = f"/blobs/uploads/{upload}"
    assert client.t.json("PUT", path, params={"offset": 0, "total": len(data)}, data=data[:MIB])["received"] == MIB
    with pytest.raises(ApiError, match=r"holds 1048576 of its 3145728 bytes: PUT the rest \(from \?offset=1048576\)"):
        client.t.json("POST", f"{path}/finish", json={"size": len(data)})
    with pytest.raises(ApiError, match="holds 0 of its"):  # the same id is another upload for another user
        second_client.t.json("POST", f"{path}/finish", json={"size": len(data)})
    assert second_client.t.request("HEAD", path).headers["X-Received"] == "0"
    client.t.json("PUT", path, params={"offset": MIB, "total": len(data)}, data=data[MIB:])
    with pytest.raises(ApiError, match="hash to .* not 0000") as e:
        client.t.json("POST", f"{path}/finish", json={"size": len(data), "sha256": "0" * 64})
    assert e.value.status == 409
    other = "/blobs/uploads/" + "f" * 32  # an unfinished upload dropped frees its quota
    client.t.json("PUT", other, params={"offset": 0, "total": len(data)}, data=data[:MIB])
    assert client.t.json("DELETE", other) == {"dropped": True}
    assert client.t.request("HEAD", other).headers["X-Received"] == "0"
    assert client.t.json("DELETE", other) == {"dropped": False}
    with pytest.raises(ApiError, match="not an upload id") as e:
        client.t.request("DELETE", "/blobs/uploads/NOT-AN-ID")
    assert e.value.status == 400


@pytest.fixture
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "aibro"
    monkeypatch.setenv("AIBRO_HOME", str(home))
    for var in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    yield home
    config.stop_embedded()
    kill_workers(home)


class _KillAfterFirstChunk(ArraySource):
    """Kills the backend (SIGKILL) once the upload's first chunk is stored, as a crash mid-upload would. The first
    walk over the bytes is the fingerprint (hashcache.py); the second is the upload."""

    def __init__(self, arr: np.ndarray, home: Path) -> None:
        super().__init__(arr)
        self.home = home
        self.walks = 0

    def chunks(self, start: int = 0, size: int = blobsource.CHUNK) -> Iterator[memoryview]:
        self.walks += 1
        for i, chunk in enumerate(super().chunks(start, size)):
            if self.walks == 2 and i == 1:
                pid = json.loads((self.home / "backend.json").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while config._pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            yield chunk


def test_a_one_pass_upload_resumes_after_the_backend_restarts(own_home: Path) -> None:
    client = connect()
    notices: list[str] = []
    client.notify = notices.append
    x = _random(3 * blobsource.CHUNK // 4 + 1000)  # three chunks and a bit
    source = _KillAfterFirstChunk(x, own_home)
    sha, sent = client.upload_source(source)
    assert any("restarting" in n for n in notices), notices
    assert sha == ArraySource(x).sha256(), "the name covers the bytes from before and after the restart"
    assert sent == source.size and source.walks == 2, "the kill came during the upload"
    assert client.counters()["blob_bytes_received"] <= source.size, "what arrived before the crash was kept"


def test_a_backend_that_takes_small_requests_gets_small_requests(
    own_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a proxy that caps request bodies the operator lowers AIBRO_CHUNK_MAX_BODY; HEAD says so
    (X-Chunk-Max) and the client's PUTs stay within it, an array's and a file's alike."""
    monkeypatch.setenv("AIBRO_CHUNK_MAX_BODY", str(8 << 20))  # the least it takes: a worker's artifact chunk
    client = connect()
    x = _random(5 * (1 << 20))  # 20 MiB: one larger request would be refused (413)
    sha, sent = client.upload_array(x)
    assert sha == ArraySource(x).sha256() and sent == ArraySource(x).size
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(20 << 20))
    sha, sent = client.upload_blob(path)
    assert sent == 20 << 20 and client.t.request("HEAD", f"/blobs/{sha}").status_code == 200
