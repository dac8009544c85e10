"""The probe suite's findings (issue 24 item 6), each replayed from a user's side against a real backend.

1. connections the client stops taking answers on (pipelined requests it never reads), on either port;
2. a worker artifact whose name collides with another (a file where a folder must be, or the other way round);
3. unfinished uploads without end, and stored blobs without a bound;
4. a batch size of 10**12;
5. worker folders others can read (a state/workers an older version left 0755, a worker started under umask 022);
6. a worker event batch over its route's limit, which reset the connection instead of answering 413.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import stat
import struct
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from backend_proc import OwnBackend, own_backend

from aibro_core import vocabulary as v
from aibro_core.errors import ApiError
from aibro_core.models import JobSpec
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import answered_again, instance_pid, slow_data, wait_for, worker_process

MiB = 1024 * 1024


def _call(url: str, method: str, path: str, token: str, **kw: Any) -> requests.Response:
    return requests.request(method, f"{url}/api/v1{path}", headers={"Authorization": f"Bearer {token}"}, **kw)


def _ports(b: OwnBackend) -> dict[str, int]:
    info = json.loads((b.home / "backend.json").read_text())
    return {"main": int(info["port"]), "events": int(info["events_port"])}


# -- 1. connections: idle, slow and stalled ones all end -----------------------------------------------------------
def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _slowloris(s: socket.socket, stop: threading.Event) -> None:
    """Sends a request's headers one byte every 0.3 s, never ending them."""
    head = b"GET /api/v1/events HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
    for byte in head:
        if stop.wait(0.3):
            return
        try:
            s.send(bytes([byte]))
        except OSError:
            return


def test_idle_and_slowloris_connections_end_on_both_ports(tmp_path: Path) -> None:
    """A connection that never sends a byte, and one that sends its headers a byte at a time, are closed after the
    idle timeout on the main port and on the event port alike."""
    with own_backend(tmp_path / "home", AIBRO_IDLE_TIMEOUT_S="2") as b:
        ports = _ports(b)
        stop = threading.Event()
        socks: dict[str, socket.socket] = {}
        for name, port in ports.items():
            socks[f"{name}: idle"] = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks[f"{name}: slowloris"] = slow = socket.create_connection(("127.0.0.1", port), timeout=10)
            threading.Thread(target=_slowloris, args=(slow, stop), daemon=True).start()
        try:
            still_open = [name for name, s in socks.items() if not _closed_by_server(s, 60)]
        finally:
            stop.set()
            for s in socks.values():
                s.close()
        assert still_open == []


def _unsent(s: socket.socket) -> int:
    """Bytes this socket has sent that the other side's kernel has not taken yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _stalled_reader(port: int, request: bytes) -> socket.socket:
    """A client that pipelines `request`, 16 at a time as the backend takes them, and never reads an answer, until
    the backend stops taking requests (its answers fill both sides' buffers) or drops the connection."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    waiting_since = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if _unsent(s) == 0:
                s.send(request * 16)
                waiting_since = None
                continue
        except OSError:  # the backend already gave up on it
            return s
        waiting_since = waiting_since or time.monotonic()
        if time.monotonic() - waiting_since > 3.0:
            return s
        time.sleep(0.01)
    raise AssertionError("the backend kept reading requests whose answers nobody took")


@pytest.mark.parametrize("port_name", ["main", "events"])
def test_a_client_that_never_reads_its_answers_is_dropped(tmp_path: Path, port_name: str) -> None:
    """Two clients pipeline requests and never read an answer: once their answers fill the buffers, their
    connections are dropped after the idle timeout, so they hold neither the connection cap (2 here) nor memory.
    They used to stay open for good (a response that cannot be written was never timed out), and the event port
    queued every answer in memory while it went on reading."""
    with own_backend(tmp_path / "home", AIBRO_IDLE_TIMEOUT_S="2", AIBRO_MAX_CONNECTIONS="2") as b:
        port = _ports(b)[port_name]
        auth = f"Authorization: Bearer {b.token}\r\n"
        path = "/api/v1/openapi.json" if port_name == "main" else "/api/v1/events?wait=0"
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
        rss_before = b.rss_kib()
        stalled = [_stalled_reader(port, request) for _ in range(2)]
        try:
            grown = b.rss_kib() - rss_before
            assert answered_again(lambda: b.client().health(), ApiError, within_s=60).ok
        finally:
            for s in stalled:
                s.close()
        assert grown < 64 * 1024, f"the backend grew {grown // 1024} MiB holding answers nobody read"


# -- a module backend with a training job: the worker's side -----------------------------------------------------
# the interpreter of a worker started under a permissive umask, as a Ray node or a hand-made image may
WRAPPER = '#!/bin/sh\numask 022\nexec {python} "$@"\n'


@pytest.fixture(scope="module")
def worker_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OwnBackend, str, int, str]]:
    """A backend whose home an older version made (state/workers and state/envs 0755), whose workers start under
    umask 022, with a job training for a while: (backend, job id, attempt, the worker's token)."""
    root = tmp_path_factory.mktemp("probe-worker")
    home = root / "home"
    for sub in ("state/workers", "state/envs"):
        (home / sub).mkdir(parents=True)
        (home / sub).chmod(0o755)
    wrapper = root / "python-umask-022"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    with own_backend(home, AIBRO_SANDBOX="none", AIBRO_WORKER_PYTHON=str(wrapper)) as b:
        client = b.client()
        x, y = slow_data(2000)
        job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=60, batch_size=16))
        job_id = job.job_id
        wait_for(client, job_id, lambda evs: any(e["type"] == v.EV_EPOCH for e in evs))
        job = client.job(job_id)
        pid = worker_process(instance_pid(home, job.instance_id))
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        token = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"AIBRO_WORKER_TOKEN="))
        yield b, job_id, int(job.attempt), token
        client.cancel(job_id)


# -- 2. artifact names that collide ------------------------------------------------------------------------------
def _put_artifact(b: OwnBackend, job_id: str, attempt: int, token: str, name: str) -> requests.Response:
    path = f"/worker/jobs/{job_id}/artifacts/{name}?attempt={attempt}"
    return _call(b.url, "PUT", path, token, data=b"probe bytes", timeout=60)


def test_an_artifact_name_that_collides_with_another_is_a_409_naming_both(worker_job: Any) -> None:
    b, job_id, attempt, token = worker_job
    assert _put_artifact(b, job_id, attempt, token, "probe/ok.bin").status_code == 200
    assert _put_artifact(b, job_id, attempt, token, "probe/dir/x").status_code == 200
    for name, other in (("probe/ok.bin/child", "probe/ok.bin"), ("probe/dir", "probe/dir/x")):
        resp = _put_artifact(b, job_id, attempt, token, name)
        assert resp.status_code == 409, (name, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert name in error and other in error and "another name" in error, error
    names = {a.name for a in b.client().artifacts(job_id)}
    assert {"probe/ok.bin", "probe/dir/x"} <= names and not {"probe/ok.bin/child", "probe/dir"} & names
    assert b.client().job(job_id).status == v.TRAINING


# -- 5. the worker's folders are private ---------------------------------------------------------------------------
def test_worker_folders_and_logs_are_private(worker_job: Any) -> None:
    """Whatever an older version left and whatever umask the worker started under: state/workers, state/envs and
    everything a worker writes in its folder (its log, caches, code, TensorBoard files, checkpoints) is its own."""
    b = worker_job[0]
    state = b.home / "state"
    seen, shared = 0, []
    for top in (state / "workers", state / "envs"):
        for path in [top, *top.rglob("*")]:
            if path.is_symlink():
                continue
            seen += 1
            mode = stat.S_IMODE(path.lstat().st_mode)
            if mode & 0o077:
                shared.append(f"{oct(mode)} {path.relative_to(state)}")
    assert seen > 5 and list(state.glob("workers/*/worker.log")), "the worker wrote nothing to check"
    assert shared == []


# -- 6. a body over its route's limit is answered, not reset ----------------------------------------------------
def _post_whole(b: OwnBackend, path: str, token: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST as a plain HTTP client does: the whole body first, then the answer is read (a reset loses it)."""
    head = f"POST /api/v1{path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", _ports(b)["main"]), timeout=120) as s:
        s.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"closed before an answer: {data!r}"
            data += chunk
        status_line, rest = data.split(b"\r\n", 1)
        length = int(next(h.split(b":")[1] for h in rest.split(b"\r\n") if h.lower().startswith(b"content-length:")))
        answer = data.split(b"\r\n\r\n", 1)[1]
        while len(answer) < length:
            answer += s.recv(65536)
    return int(status_line.split()[1]), json.loads(answer)


def test_a_20_mb_worker_event_is_answered_413_not_reset(worker_job: Any) -> None:
    """A body over its route's limit (a 20 MB log event to the 16 MiB event route; 5 MB to a 1 MiB JSON route) is
    answered 413 naming the limit, and read and dropped so that a client that sends it whole reads that answer;
    the connection used to be closed at once, and such a client met a reset."""
    b, job_id, attempt, token = worker_job
    event = {"type": "log", "wseq": 10**9, "data": {"message": "x" * 20_000_000}}
    body = json.dumps({"attempt": attempt, "events": [event]}).encode()
    status, answer = _post_whole(b, f"/worker/jobs/{job_id}/events", token, body)
    assert status == 413, answer
    assert f"{len(body)} bytes is over this route's limit of {16 * MiB} bytes" in answer["error"]
    spec = json.dumps({"model": "0" * 64, "pad": "x" * 5_000_000}).encode()
    status, answer = _post_whole(b, "/jobs", b.token, spec)
    assert status == 413 and "limit of 1048576 bytes" in answer["error"], answer
    assert b.client().job(job_id).status == v.TRAINING


# -- 3. unfinished and stored bytes: bounded per user, and shown ---------------------------------------------------
def _put_blob(client: BackendClient, data: bytes, total: int | None = None) -> dict[str, Any]:
    sha = hashlib.sha256(data).hexdigest()
    params = {"offset": 0, "total": len(data) if total is None else total}
    return client.t.json("PUT", f"/blobs/{sha}", params=params, data=data)


def _held(client: BackendClient, data: bytes) -> bool:
    return client.t.request("HEAD", f"/blobs/{hashlib.sha256(data).hexdigest()}").status_code == 200


def test_unfinished_uploads_are_bounded_in_number_and_shown(tmp_path: Path) -> None:
    """A user starting uploads declared at 2 GiB that never finish: the sixth is a 429 naming the limit of five
    and the fix; /health shows what they hold; dropping one makes room."""
    with own_backend(tmp_path / "home", AIBRO_MAX_PARTIAL_UPLOADS="5") as b:
        client = b.client()
        starts = [os.urandom(100) for _ in range(6)]
        for data in starts[:5]:
            assert _put_blob(client, data, total=2 * 1024**3) == {"complete": False, "received": 100}
        with pytest.raises(ApiError, match=r"5 unfinished uploads.*limit of 5.*DELETE /blobs/SHA") as e:
            _put_blob(client, starts[5], total=2 * 1024**3)
        assert e.value.status == 429
        quota = client.health().quota
        assert (quota.pending_uploads, quota.max_pending_uploads, quota.pending_bytes) == (5, 5, 500)
        assert quota.max_pending_bytes == 2 * 2 * 1024**3
        client.t.json("DELETE", f"/blobs/{hashlib.sha256(starts[0]).hexdigest()}")
        assert _put_blob(client, starts[5], total=2 * 1024**3)["received"] == 100


def test_stored_blobs_are_bounded_per_user_and_shown(tmp_path: Path) -> None:
    """A limit of 10,000 stored bytes: a fourth blob of 3,000 bytes makes room by dropping the one least recently
    used that no active job reads (the client uploads it again when it needs it); a blob over the limit is a 413
    at its first chunk; when the blobs active jobs read leave no room, the upload is a 413 naming the limit and
    the fix. No job ever starts here (no instances allowed), so the one submitted stays queued."""
    env = {"AIBRO_MAX_STORED_BYTES": "10000", "AIBRO_MAX_ACTIVE_INSTANCES": "0"}
    with own_backend(tmp_path / "home", **env) as b:
        client = b.client()
        blobs = [os.urandom(3000) for _ in range(6)]
        for data in blobs[:3]:
            assert _put_blob(client, data)["complete"]
        assert _held(client, blobs[0])  # used again: blobs[1] is now the least recently used
        assert _put_blob(client, blobs[3])["complete"]
        assert [_held(client, data) for data in blobs[:4]] == [True, False, True, True]
        quota = client.health().quota
        assert (quota.stored_bytes, quota.max_stored_bytes) == (9000, 10000)

        with pytest.raises(ApiError, match=r"20000 bytes.*limit of 10000 bytes") as e:
            _put_blob(client, os.urandom(20000))
        assert e.value.status == 413

        shas = [hashlib.sha256(data).hexdigest() for data in blobs]
        spec = {"model": shas[0], "data": {"x": {"blob": shas[2]}, "y": {"blob": shas[3]}}, "machines": ["local-cpu"]}
        job = client.submit(JobSpec.model_validate(spec))
        assert job.status == v.QUEUING
        with pytest.raises(ApiError, match=r"active jobs read 9000 bytes.*limit of 10000 bytes.*cancel") as e:
            _put_blob(client, blobs[4])
        assert e.value.status == 413
        assert [_held(client, data) for data in (blobs[0], blobs[2], blobs[3])] == [True, True, True]
        client.cancel(job.job_id)
        assert _put_blob(client, blobs[4])["complete"]
        assert client.health().quota.stored_bytes <= 10000
        gone = [data for data in (blobs[0], blobs[2], blobs[3]) if not _held(client, data)]
        assert len(gone) == 1
        blob_files = list((b.home / "state" / "blobs" / "blobs").iterdir())
        assert len(blob_files) == 3, "a blob nobody holds any more still takes its disk"


# -- 4. batch sizes and steps ------------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("field", ["batch_size", "validation_batch_size", "steps_per_epoch", "validation_steps"])
def test_a_batch_size_or_step_count_of_10_to_the_12_is_a_400_naming_it(client: BackendClient, field: str) -> None:
    spec = {
        "model": "0" * 64,
        "data": {"x": {"blob": "0" * 64}},
        "fit": {"epochs": 1, field: 10**12},
        "machines": ["local-cpu"],
    }
    pattern = rf"fit\.{field} must be a positive integer of at most \d+ .*, got 1000000000000"
    with pytest.raises(ApiError, match=pattern) as e:
        client.t.json("POST", "/jobs", json=spec)  # as a client that skips the kernel's checks sends it
    assert e.value.status == 400
