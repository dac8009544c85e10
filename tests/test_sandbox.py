"""A user's own code runs on the worker (a Lambda layer here; custom layers and travelling modules go through the
same door), so the worker is sandboxed: the attack that once read every other user's data is replayed as an
`--unsafe` Lambda job, and every read must fail. Runs where the README's test command ran (bubblewrap installed)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import keras
import pytest
from backend_proc import own_backend

from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.errors import ApiError
from aibro_jupyter.fitrequest import FitRequest

from helpers import backend_db, wait_for

ATTACK = """
import json, os


def attempt(found, name, fn):
    try:
        found[name] = "READ " + str(fn())[:80]
    except Exception as exc:
        found[name] = type(exc).__name__


def probe(home, own, others):
    found = {{"uid": os.getuid(), "env": sorted(k for k in os.environ if k in ("AIBRO_HOME", "AIBRO_TOKEN"))}}
    attempt(found, "database", lambda: open(home + "/state/aibro.db", "rb").read(16))
    attempt(found, "database_write", lambda: open(home + "/state/aibro.db", "ab").write(b"x"))
    attempt(found, "credentials", lambda: open(home + "/credentials.json").read())
    attempt(found, "backend_json", lambda: open(home + "/backend.json").read())
    attempt(found, "blob_dir", lambda: os.listdir(home + "/state/blobs/blobs"))
    attempt(found, "other_blob", lambda: open(home + "/state/blobs/blobs/{other_blob}", "rb").read(8))
    attempt(found, "artifacts", lambda: os.listdir(home + "/state/blobs/artifacts"))
    attempt(found, "other_worker", lambda: os.listdir(home + "/state/workers/{other_instance}"))
    attempt(found, "workers", lambda: [w for w in os.listdir(home + "/state/workers") if w not in others] or 1 / 0)
    attempt(found, "backend_environ", lambda: open("/proc/{backend_pid}/environ", "rb").read(64))
    attempt(found, "processes", lambda: [p for p in os.listdir("/proc") if p.isdigit() and int(p) > 3] or 1 / 0)
    attempt(found, "test_files", lambda: os.listdir({tests!r}))
    attempt(found, "shadow", lambda: open("/etc/shadow").read(8))
    with open(own + "/probe.json", "w") as f:  # its own directory: the test reads the report from outside
        json.dump(found, f)


if "AIBRO_WORKER_DIR" in os.environ:  # in the kernel, while the model is built, there is nothing to see
    own = os.environ["AIBRO_WORKER_DIR"]
    probe({home!r}, own, (os.path.basename(own),))
"""


@pytest.fixture(scope="module")
def sandboxed(client: BackendClient) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: the README's test command installs it (apt-get install bubblewrap)")


def _final(event: dict[str, Any]) -> bool:
    return event["type"] == "status" and event["data"].get("status") in ("COMPLETED", "CANCELED")


def _attack_model(home: Path, other_blob: str, other_instance: str, backend_pid: int) -> Any:
    src = ATTACK.format(
        home=str(home),
        other_blob=other_blob,
        other_instance=other_instance,
        backend_pid=backend_pid,
        tests=str(Path(__file__).parent),
    )
    attack = eval(f"lambda t: (exec({src!r}, {{}}), t)[1]")  # noqa: S307 - a Lambda travels as its bytecode
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Lambda(attack), keras.layers.Dense(10, activation="softmax")]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def test_a_lambda_job_cannot_read_the_backend_or_other_users(
    sandboxed: None, client: BackendClient, aibro_home: Path, digits: Any
) -> None:
    x, y = digits[0][:128], digits[1][:128]
    other_blob = backend_db(aibro_home, "SELECT sha FROM blobs LIMIT 1")
    other_instance = f"inst-decoy-{os.getpid()}"  # another worker's folder (a real one may be this job's, warm)
    decoy = aibro_home / "state" / "workers" / other_instance
    decoy.parent.mkdir(mode=0o700, exist_ok=True)  # no worker may have run yet when this test runs first
    decoy.mkdir(mode=0o700, exist_ok=True)
    (decoy / "worker-token").write_text("secret")
    backend_pid = json.loads((aibro_home / "backend.json").read_text())["pid"]
    model = _attack_model(
        aibro_home,
        other_blob[0][0] if other_blob else "0" * 64,
        other_instance,
        backend_pid,
    )
    # warm (cooling), so that its folder with the report stays until the test reads it
    job = Training(client).submit(
        FitRequest(model, x, y, machine_ids="local-cpu", epochs=1, safe_mode=False, cool_down_period_s=600)
    )
    wait_for(client, job.job_id, lambda evs: any(_final(e) for e in evs), timeout=300)
    done = client.job(job.job_id)
    assert done.status == "COMPLETED", done.error
    report = aibro_home / "state" / "workers" / done.instance_id / "probe.json"
    assert report.exists(), "the attack ran on the worker and wrote its report"
    found = json.loads(report.read_text())
    assert found["env"] == [], "no AIBRO_HOME or AIBRO_TOKEN in the worker's environment"
    assert found["uid"] >= 200_000, "the worker runs as an unprivileged uid of its own"
    reads = {k: val for k, val in found.items() if k not in ("uid", "env")}
    assert len(reads) == 13
    leaked = {k: val for k, val in reads.items() if str(val).startswith("READ")}
    assert not leaked, f"the worker could read: {leaked}"
    # each attempt failed because the thing is not there or not readable (a NameError would mean a broken probe)
    blocked = {"FileNotFoundError", "PermissionError", "ZeroDivisionError", "OSError"}
    assert set(reads.values()) <= blocked, reads
    assert reads["database"] == "FileNotFoundError" and reads["processes"] == "ZeroDivisionError", reads


def test_serve_refuses_unsafe_jobs_unless_the_policy_allows_the_user(client: BackendClient, tmp_path: Path) -> None:
    """A shared backend (`aibro backend serve`, here `python -m aibro_backend`) refuses safe_mode=False unless
    AIBRO_ALLOW_UNSAFE names the user; the embedded backend lets its one user opt in (`--unsafe`)."""
    assert client.policy().allow_unsafe == "all", "the embedded backend's one user may use --unsafe"
    spec = {"model": "0" * 64, "data": {"x": {"blob": "0" * 64}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}
    for allow, refused in ((None, True), ("someone-else", True), ("local", False)):
        home = tmp_path / f"serve-{allow}"
        extra = {"AIBRO_ALLOW_UNSAFE": allow} if allow else {}
        with own_backend(home, **extra) as backend:
            with pytest.raises(ApiError) as err:
                backend.client().t.json("POST", "/jobs", json={**spec, "safe_mode": False})
            if refused:
                assert err.value.status == 403 and "AIBRO_ALLOW_UNSAFE" in str(err.value), str(err.value)
            else:
                assert err.value.status == 400 and "was not uploaded" in str(err.value), "past the policy check"


def test_cool_down_over_the_cap_is_refused(client: BackendClient, digits: Any) -> None:
    """Warm machines are held at most an hour (the policy's cap, like SageMaker's warm pools): the kernel says so
    before uploading, and the backend refuses it from clients that skip the kernel's check."""
    from aibro_jupyter.errors import ValidationError

    from conftest import make_model

    assert client.policy().max_cool_down_s == 3600
    x, y = digits[0][:64], digits[1][:64]
    with pytest.raises(ValidationError, match=r"cool_down_period_s=7200 is over this backend's cap of 3600 s"):
        Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", cool_down_period_s=7200))
    spec = {"model": "0" * 64, "data": {"x": {"blob": "0" * 64}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}
    with pytest.raises(ApiError, match=r"over this backend's cap"):
        client.t.json("POST", "/jobs", json={**spec, "cool_down_s": 7200})  # a client that skips the kernel's check


def _zombie_children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == pid:
                found.append(int(proc.name))
    return found


def test_exited_workers_are_reaped(client: BackendClient, aibro_home: Path, digits: Any) -> None:
    """A worker that has exited (its instance closed after the job) leaves no zombie behind the backend."""
    import time

    from conftest import make_model

    job = Training(client).submit(
        FitRequest(make_model(), digits[0][:64], digits[1][:64], machine_ids="local-cpu", epochs=1)
    )
    wait_for(client, job.job_id, lambda evs: any(_final(e) for e in evs), timeout=300)
    instance = client.job(job.job_id).instance_id
    backend_pid = json.loads((aibro_home / "backend.json").read_text())["pid"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        closed = {i.id: i.status for i in client.instances()}.get(instance) == "CLOSED"
        if closed and not _zombie_children(backend_pid):
            return
        time.sleep(0.5)
    raise AssertionError(f"zombies left behind the backend: {_zombie_children(backend_pid)}")
