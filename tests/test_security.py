"""Tokens on every route, one user never sees another's jobs, blobs or instances, worker tokens reach only their
own assignment, secrets are 0600 and the backend listens on loopback only."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
import requests

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import aibro_cli, instance_pid, user_env, wait_for

SHA = "a" * 64
ROUTES = [
    ("GET", "/health"),
    ("GET", "/machines"),
    ("GET", "/policy"),
    ("GET", "/stats"),
    ("POST", "/auth/tokens"),
    ("HEAD", f"/blobs/{SHA}"),
    ("PUT", f"/blobs/{SHA}?offset=0&total=1"),
    ("GET", "/jobs"),
    ("POST", "/jobs"),
    ("GET", "/jobs/job-x"),
    ("POST", "/jobs/job-x/cancel"),
    ("POST", "/jobs/job-x/replay"),
    ("GET", "/jobs/job-x/events"),
    ("GET", "/events"),
    ("GET", "/jobs/job-x/artifacts"),
    ("GET", "/jobs/job-x/artifacts/model.keras"),
    ("GET", "/instances"),
    ("POST", "/instances/i-x/terminate"),
    ("GET", "/openapi.json"),
    ("GET", "/worker/assignment"),
    ("GET", f"/worker/blobs/{SHA}"),
    ("POST", "/worker/jobs/job-x/events"),
    ("GET", "/worker/jobs/job-x/artifacts/model.keras"),
    ("PUT", "/worker/jobs/job-x/artifacts/model.keras"),
    ("POST", "/worker/jobs/job-x/finish"),
]


def _call(url: str, method: str, path: str, token: str | None, **kw: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, f"{url}/api/v1{path}", headers=headers, timeout=30, **kw)


def _npy_sha(arr: np.ndarray) -> str:
    """The digest of the .npy blob `arr` travels as (the same encoding the bundle uses)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _spec(sha: str) -> dict[str, Any]:
    return {"model": sha, "data": {"x": {"blob": sha}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}


# -- tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "wrong"])
def test_every_route_needs_a_token(client: BackendClient, token: str | None) -> None:
    for method, path in ROUTES:
        resp = _call(client.url, method, path, token)
        assert resp.status_code == 401, (method, path, resp.status_code)
        if method != "HEAD":
            body = resp.json()
            assert "token" in body["error"], (method, path, body)


def test_user_token_is_not_a_worker_token(client: BackendClient) -> None:
    for method, path in [
        ("GET", "/worker/assignment"),
        ("GET", f"/worker/blobs/{SHA}"),
        ("POST", "/worker/jobs/job-x/events"),
    ]:
        resp = _call(client.url, method, path, client.t.token)
        assert resp.status_code == 401 and resp.json()["error"] == "unknown worker token", (method, path)


# -- files and sockets --------------------------------------------------------------------------------------
def test_secrets_are_private(aibro_home: Path, client: BackendClient) -> None:
    for name in ("backend.json", "credentials.json"):
        assert stat.S_IMODE((aibro_home / name).stat().st_mode) == 0o600, name


def test_backend_listens_on_loopback_only(client: BackendClient) -> None:
    url = urlparse(client.url)
    assert url.scheme == "http" and url.hostname == "127.0.0.1"
    # Bound to 127.0.0.1 (not 0.0.0.0), it does not even answer on another loopback address.
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", url.port), timeout=5):
        pass


def test_openapi_document(client: BackendClient) -> None:
    doc = client.t.json("GET", "/openapi.json")
    assert doc["openapi"].startswith("3.")
    for path in ("/jobs", "/jobs/{job_id}/events", "/blobs/{sha256}", "/events", "/instances"):
        assert path in doc["paths"], path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


# -- a second user -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bob(client: BackendClient, aibro_home: Path, tmp_path_factory: pytest.TempPathFactory) -> BackendClient:
    """A second user, made as an admin would: `aibro backend add-user bob` on the backend's host, then
    `aibro login` from bob's own home."""
    made = aibro_cli(aibro_home, "backend", "add-user", "bob")
    assert made.returncode == 0, made.stderr[-2000:]
    token = re.search(r"--token=(\S+)", made.stdout).group(1)
    bob_home = tmp_path_factory.mktemp("bob-home")
    login = aibro_cli(bob_home, "login", client.url, "--token", token)
    assert login.returncode == 0, login.stderr[-2000:]
    assert stat.S_IMODE((bob_home / "login.json").stat().st_mode) == 0o600
    status = aibro_cli(bob_home, "backend", "status")
    assert "configured backend" in status.stdout and "user bob" in status.stdout, status.stdout
    assert not (bob_home / "credentials.json").exists(), "a logged-in client must not start its own backend"
    bob = BackendClient(client.url, token)
    assert bob.health().user == "bob"
    return bob


def test_add_user_refuses_bad_names_and_mints_a_new_token_each_time(client: BackendClient, aibro_home: Path) -> None:
    for bad in ["Bob Smith", "../etc", "x" * 65, ""]:
        out = aibro_cli(aibro_home, "backend", "add-user", bad)
        assert out.returncode == 2 and "token" not in out.stdout, (bad, out.stdout)
        assert ("is not valid" in out.stderr and "e.g. alice" in out.stderr) or "needs a name" in out.stderr, bad
    tokens = []
    for _ in range(2):
        out = aibro_cli(aibro_home, "backend", "add-user", "carol")
        assert out.returncode == 0, out.stderr[-2000:]
        tokens.append(re.search(r"--token=(\S+)", out.stdout).group(1))
    assert tokens[0] != tokens[1]
    assert [BackendClient(client.url, t).health().user for t in tokens] == ["carol", "carol"]
    out = aibro_cli(aibro_home.parent / "nowhere", "backend", "add-user", "dave")
    assert out.returncode == 2 and "no backend store" in out.stderr, out.stderr


def test_tokens_never_begin_with_a_dash_and_login_takes_every_form(
    client: BackendClient, aibro_home: Path, tmp_path: Path
) -> None:
    """A token that began with '-' (1 in 64 before) broke `aibro login URL --token TOKEN` in argparse."""
    from aibro_core.files import new_token

    assert not any(new_token(kind).startswith("-") for kind in ("u", "w") for _ in range(2000))
    out = aibro_cli(aibro_home, "backend", "add-user", "erin")
    token = re.search(r"--token=(\S+)", out.stdout).group(1)
    assert token.startswith("aibro_u_") and "--token-stdin" in out.stdout
    for n, args, stdin in [
        (1, ["--token", token], None),
        (2, [f"--token={token}"], None),
        (3, ["--token-stdin"], token + "\n"),
        (4, [], token + "\n"),  # no tty: read from stdin, never from argv
    ]:
        home = tmp_path / f"erin{n}"
        done = subprocess.run(
            [sys.executable, "-m", "aibro_jupyter.cli", "login", client.url, *args],
            input=stdin or "",
            env=user_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert json.loads((home / "login.json").read_text())["token"] == token
    bad = subprocess.run(
        [sys.executable, "-m", "aibro_jupyter.cli", "login", client.url, "--token-stdin"],
        input="\n",
        env=user_env(tmp_path / "nobody"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no token given" in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def local_job(
    client: BackendClient, digits: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
) -> Iterator[tuple[str, str]]:
    """A tiny job of user "local" (its instance is kept cooling); yields (job_id, sha of its x blob)."""
    x, y = digits[0][:64], digits[1][:64]
    trainer = Training(client)
    job_id = trainer.submit(
        FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, cool_down_period_s=600)
    ).job_id
    yield job_id, _npy_sha(x)
    wait_final(client, job_id)
    inst_id = client.job(job_id).instance_id
    if inst_id and any(i.id == inst_id and i.status == v.COOLING for i in client.instances()):
        client.terminate(inst_id)


def wait_final(client: BackendClient, job_id: str) -> str:
    """Follow the job until its final status event and return that status.

    (Not Training.watch, which idles through one full long-poll wait after the job is final.)"""
    events = wait_for(client, job_id, lambda evs: any(_final(e) for e in evs))
    return next(e["data"]["status"] for e in events if _final(e))


def _final(event: dict[str, Any]) -> bool:
    return event["type"] == "status" and event["data"].get("status") in v.JOB_FINAL


def _bob_sees_nothing_of(bob: BackendClient, job_id: str) -> None:
    assert job_id not in [j.job_id for j in bob.jobs()]
    for method, path in [
        ("GET", f"/jobs/{job_id}"),
        ("GET", f"/jobs/{job_id}/events"),
        ("GET", f"/jobs/{job_id}/artifacts"),
        ("GET", f"/jobs/{job_id}/artifacts/model.keras"),
        ("POST", f"/jobs/{job_id}/cancel"),
        ("POST", f"/jobs/{job_id}/replay"),
    ]:
        resp = _call(bob.url, method, path, bob.t.token)
        assert resp.status_code == 404, (method, path, resp.status_code)
        assert "no job" in resp.json()["error"], (method, path)
    assert [e for e in bob.user_events()["events"] if e["job_id"] == job_id] == []
    assert bob.instances() == []


def test_users_are_isolated(client: BackendClient, bob: BackendClient, local_job: tuple[str, str]) -> None:
    job_id, x_sha = local_job
    _bob_sees_nothing_of(bob, job_id)  # while the job is (most likely) still running
    assert wait_final(client, job_id) == v.COMPLETED
    _bob_sees_nothing_of(bob, job_id)  # and once it is done, with artifacts
    job = client.job(job_id)
    assert not job.cancel_requested  # bob's cancel did nothing
    assert "model.keras" in [a.name for a in client.artifacts(job_id)]

    # local's instance (cooling): bob neither sees nor terminates it
    inst_id = job.instance_id
    assert inst_id in [i.id for i in client.instances()]
    resp = _call(bob.url, "POST", f"/instances/{inst_id}/terminate", bob.t.token)
    assert resp.status_code == 404 and "no instance" in resp.json()["error"]
    assert {i.id: i.status for i in client.instances()}[inst_id] == v.COOLING

    # local's blobs: bob cannot see them, nor use them in a job without sending the bytes himself
    assert client.t.request("HEAD", f"/blobs/{x_sha}").status_code == 200
    head = bob.t.request("HEAD", f"/blobs/{x_sha}")
    assert head.status_code == 404 and head.headers["X-Received"] == "0"
    resp = _call(bob.url, "POST", "/jobs", bob.t.token, json=_spec(x_sha))
    assert resp.status_code == 400 and "was not uploaded by this user" in resp.json()["error"]
    assert bob.jobs() == []


def _worker_token(home: Path, instance_id: str) -> str:
    """The token the backend gave this instance's worker (from the worker process's own environment)."""
    env = Path(f"/proc/{instance_pid(home, instance_id)}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"AIBRO_WORKER_TOKEN="))


def test_worker_token_reaches_only_its_assignment(
    client: BackendClient, aibro_home: Path, local_job: tuple[str, str]
) -> None:
    job_id, x_sha = local_job
    wait_final(client, job_id)
    inst_id = client.job(job_id).instance_id
    token = _worker_token(aibro_home, inst_id)

    # a worker token is not a user token
    for method, path in [("GET", "/jobs"), ("GET", f"/jobs/{job_id}"), ("GET", "/health")]:
        assert _call(client.url, method, path, token).status_code == 401, (method, path)

    # cooling, the instance has no assignment: the job it ran is out of its reach now
    assert _call(client.url, "GET", "/worker/assignment", token).json()["action"] == "wait"
    resp = _call(client.url, "GET", f"/worker/blobs/{x_sha}", token)
    assert resp.status_code == 403 and "not part of the job assigned" in resp.json()["error"]
    resp = _call(client.url, "GET", f"/worker/jobs/{job_id}/artifacts/model.keras", token)
    assert resp.status_code == 409 and "is not assigned to" in resp.json()["error"]
    resp = _call(client.url, "PUT", f"/worker/jobs/{job_id}/artifacts/extra.txt?attempt=0", token, data=b"x")
    assert resp.status_code == 409
    events = {"attempt": 0, "events": [{"type": "log", "wseq": 10_000, "data": {"message": "injected"}}]}
    resp = _call(client.url, "POST", f"/worker/jobs/{job_id}/events", token, json=events)
    assert resp.status_code == 409
    assert "extra.txt" not in [a.name for a in client.artifacts(job_id)]
    assert "injected" not in [e["data"].get("message") for e in client.events(job_id)["events"]]


# -- blobs across users ----------------------------------------------------------------------------------------
def test_another_users_blob_cannot_be_claimed_without_its_bytes(
    client: BackendClient, bob: BackendClient, tmp_path: Path
) -> None:
    """Content addressing must not let bob take over local's blob by sending only its final byte."""
    data = os.urandom(50_000)
    path = tmp_path / "secret.bin"
    path.write_bytes(data)
    sha, sent = client.upload_blob(path)
    assert sent == len(data)
    last = len(data) - 1
    _call(bob.url, "PUT", f"/blobs/{sha}?offset={last}&total={len(data)}", bob.t.token, data=data[last:])
    assert bob.t.request("HEAD", f"/blobs/{sha}").status_code == 404, "bob owns local's blob after sending 1 byte"
    resp = _call(bob.url, "POST", "/jobs", bob.t.token, json=_spec(sha))
    assert resp.status_code == 400


def test_a_partial_upload_is_neither_visible_nor_spoilable_by_another_user(
    client: BackendClient, bob: BackendClient, tmp_path: Path
) -> None:
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    client.t.json("PUT", f"/blobs/{sha}", params={"offset": 0, "total": len(data)}, data=data[:100_000])
    problems = []
    seen = bob.t.request("HEAD", f"/blobs/{sha}").headers["X-Received"]
    if seen != "0":
        problems.append(f"bob sees local's upload progress (X-Received: {seen})")
    _call(bob.url, "PUT", f"/blobs/{sha}?offset=100000&total={len(data)}", bob.t.token, data=b"\0" * 1000)
    try:
        client.upload_blob(path)
    except Exception as exc:  # noqa: BLE001 - the failure itself is what this test reports
        problems.append(f"local's resumed upload failed after bob's write: {exc}")
    if client.t.request("HEAD", f"/blobs/{sha}").status_code != 200:
        problems.append("local's blob is not complete")
    assert problems == []
