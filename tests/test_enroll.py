"""Enrollment (issue 11 item 4): a machine whose launch data anyone on it can read (EC2 user data) starts with a
one-time enrollment token, never a long-lived one; the worker agent exchanges it once at POST /worker/enroll for
its per-instance worker token, keeps that in a 0600 file for the boots after a stop/start, and the backend keeps
only hashes. Here the local provider runs in that mode (AIBRO_LOCAL_ENROLL=1): a real job trains through an
enrolled worker."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from backend_proc import OwnBackend, own_backend

from aibro_backend.storage.store import Store
from aibro_backend.storage.tokens import hash_token
from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import backend_db, instance_pid, slow_data, wait_for, worker_process

HANG_S = 500  # the agent exits by itself (refused, or its job done): this bound only ends a hang, never a slow box


def _final(events: list[dict]) -> bool:
    return any(e["type"] == "status" and e["data"].get("status") in v.JOB_FINAL for e in events)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBackend]:
    with own_backend(tmp_path_factory.mktemp("enroll") / "home", AIBRO_LOCAL_ENROLL="1") as b:
        yield b


def _enroll(b: OwnBackend, token: str | None, body: dict | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(f"{b.url}/api/v1/worker/enroll", json=body or {}, headers=headers, timeout=30)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_job_trains_through_an_enrolled_worker_and_the_token_is_kept_0600(backend: OwnBackend) -> None:
    client = backend.client()
    x, y = slow_data(3000)
    job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, batch_size=16))
    wait_for(client, job.job_id, lambda evs: any(e["type"] == "epoch" for e in evs), timeout=300)
    instance_id = client.job(job.job_id).instance_id
    env = _environ(worker_process(instance_pid(backend.home, instance_id)))
    assert "AIBRO_WORKER_TOKEN" not in env, "the worker starts with no long-lived token"
    enroll_token = env["AIBRO_ENROLL_TOKEN"]
    events = wait_for(client, job.job_id, _final, timeout=300)
    assert client.job(job.job_id).status == v.COMPLETED, [e["data"] for e in events if e["type"] == "error"]

    token_file = backend.home / "state" / "workers" / instance_id / "worker-token"
    mode = stat.S_IMODE(token_file.stat().st_mode)
    assert mode == 0o600, oct(mode)
    worker_token = token_file.read_text().strip()
    assert worker_token.startswith("aibro_w_")

    # The store keeps hashes only: neither secret appears in the database, the worker token's hash does.
    db_bytes = b"".join(p.read_bytes() for p in (backend.home / "state").glob("aibro.db*"))
    assert enroll_token.encode() not in db_bytes and worker_token.encode() not in db_bytes
    rows = backend_db(backend.home, "SELECT token_hash, enroll_hash FROM instances WHERE id=?", instance_id)
    assert rows == [(hash_token(worker_token), None)], "the enrollment token is burnt, the worker token hashed"

    # Used once: a second use is refused, whether as bearer or in the body.
    for answer in (_enroll(backend, enroll_token), _enroll(backend, None, {"enroll_token": enroll_token})):
        assert answer.status_code == 401, answer.text
        assert "already used" in answer.json()["error"]


def test_a_restart_reuses_the_kept_token_and_a_burnt_enrollment_buys_nothing(
    backend: OwnBackend, tmp_path: Path
) -> None:
    """The agent restarted after a stop/start: its enrollment token is burnt, the token file is what lets it in."""
    client = backend.client()
    x, y = slow_data(3000)
    job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, batch_size=16))
    wait_for(client, job.job_id, lambda evs: any(e["type"] == "epoch" for e in evs), timeout=300)
    instance_id = client.job(job.job_id).instance_id
    env = _environ(worker_process(instance_pid(backend.home, instance_id)))
    wait_for(client, job.job_id, _final, timeout=300)
    token_file = backend.home / "state" / "workers" / instance_id / "worker-token"
    base = {k: val for k, val in os.environ.items() if not k.startswith("AIBRO_")}

    def agent(token_path: Path) -> subprocess.CompletedProcess:
        run_env = {
            **base,
            "AIBRO_WORKER_URL": env["AIBRO_WORKER_URL"],
            "AIBRO_INSTANCE_ID": instance_id,
            "AIBRO_ENROLL_TOKEN": env["AIBRO_ENROLL_TOKEN"],
            "AIBRO_WORKER_TOKEN_FILE": str(token_path),
            "AIBRO_WORKER_DIR": str(tmp_path / "work"),
        }
        cmd = [sys.executable, "-m", "aibro_backend.worker"]
        return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=HANG_S)

    # The instance is closed after its job (no cool-down): the kept token still authenticates, so the backend
    # answers "exit" to it (an unknown token would be refused: "leaving").
    reused = agent(token_file)
    assert reused.returncode == 0, reused.stdout + reused.stderr
    assert "instance closing; exiting" in reused.stdout + reused.stderr, reused.stdout + reused.stderr
    # Without the file, the burnt enrollment token is refused and the agent says so and stops.
    fresh = agent(tmp_path / "none" / "worker-token")
    assert fresh.returncode == 3, fresh.stdout + fresh.stderr
    assert "cannot enroll" in fresh.stdout + fresh.stderr and "already used" in fresh.stdout + fresh.stderr
    assert not (tmp_path / "none" / "worker-token").exists()


def test_an_expired_or_unknown_enrollment_token_is_refused(backend: OwnBackend) -> None:
    store = Store(backend.home / "state" / "aibro.db")
    try:
        uid = store.users.ensure("enroll-expiry")
        token = "aibro_e_" + "x" * 40
        store.instances.create("inst-expiring", uid, "local", "local-cpu", "aibro_w_unused", 0, token, enroll_ttl_s=0.2)
    finally:
        store.close()
    time.sleep(0.5)
    expired = _enroll(backend, "aibro_e_" + "x" * 40)
    assert expired.status_code == 401 and "expired" in expired.json()["error"], expired.text
    unknown = _enroll(backend, "aibro_e_" + "y" * 40)
    assert unknown.status_code == 401 and "unknown" in unknown.json()["error"], unknown.text
    nothing = _enroll(backend, None)
    assert nothing.status_code == 401 and "enrollment needs" in nothing.json()["error"], nothing.text
    bad = _enroll(backend, None, {"enroll_token": "short"})
    assert bad.status_code == 400, bad.text


def test_store_enroll_answers_once() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "s.db")
        uid = store.users.ensure("u")
        store.instances.create("inst-a", uid, "aws", "g4dn.xlarge", "aibro_w_never", 60, "aibro_e_" + "a" * 30)
        inst, token = store.instances.enroll("aibro_e_" + "a" * 30)
        assert inst is not None and inst.id == "inst-a" and token.startswith("aibro_w_")
        assert store.instances.for_token(token).id == "inst-a"
        assert store.instances.for_token("aibro_w_never") is None, "the launch-time token is replaced"
        assert store.instances.enroll("aibro_e_" + "a" * 30) == (None, "unknown or already used enrollment token")
        assert not hasattr(inst, "enroll_hash") and not hasattr(inst, "token_hash"), "a row never carries the hashes"
        store.close()


def _agent_without_backend(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: val for k, val in os.environ.items() if not k.startswith("AIBRO_")}
    env.update(
        AIBRO_WORKER_URL=f"http://127.0.0.1:{port}",
        AIBRO_INSTANCE_ID="inst-gone",
        AIBRO_WORKER_DIR=str(tmp_path / "work"),
        AIBRO_BACKEND_GONE_S="1",
        AIBRO_SHUTDOWN_COMMAND=f"touch {tmp_path / 'shut-down'}",
        **extra,
    )
    cmd = [sys.executable, "-m", "aibro_backend.worker"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)


def test_a_cloud_agent_whose_backend_is_gone_shuts_its_machine_down(tmp_path: Path) -> None:
    """Issue 11 item 8: nothing leaks money. A machine whose agent cannot reach the backend for
    AIBRO_BACKEND_GONE_S shuts itself down when its user data asks (AIBRO_SHUTDOWN_ON_LOSS=1), whether it was
    training already or still enrolling; the local provider's workers never do."""
    trained = _agent_without_backend(tmp_path, AIBRO_WORKER_TOKEN="aibro_w_x", AIBRO_SHUTDOWN_ON_LOSS="1")
    assert (tmp_path / "shut-down").exists(), trained.stdout + trained.stderr
    assert "shutting this machine down" in trained.stdout + trained.stderr
    (tmp_path / "shut-down").unlink()
    enrolling = _agent_without_backend(tmp_path, AIBRO_ENROLL_TOKEN="aibro_e_" + "z" * 30, AIBRO_SHUTDOWN_ON_LOSS="1")
    assert enrolling.returncode == 4 and (tmp_path / "shut-down").exists(), enrolling.stdout + enrolling.stderr
    (tmp_path / "shut-down").unlink()
    local = _agent_without_backend(tmp_path, AIBRO_WORKER_TOKEN="aibro_w_x")
    assert local.returncode == 0 and not (tmp_path / "shut-down").exists(), local.stdout + local.stderr
