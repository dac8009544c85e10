"""The spare worker (issue 14 item 1): a backend with AIBRO_SPARE_WORKER=1 keeps one local worker that has
already imported TensorFlow, hands it the next local-cpu instance of the user it was started for, then starts the
next one; it is never handed to another user, goes away with the backend, and is off when the knob is off."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from backend_proc import own_backend

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import instance_pid, wait_for, worker_process


def _final(events: list[dict]) -> bool:
    return any(e["type"] == "status" and e["data"].get("status") in v.JOB_FINAL for e in events)


def spares(home: Path) -> dict[int, Path]:
    """Live spare worker processes of this backend: their python's pid → their work directory."""
    found: dict[int, Path] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[0] == b"bwrap" or b"aibro_backend.worker.spare" not in cmd:
            continue
        for item in env:
            if item.startswith(b"AIBRO_WORKER_DIR=") and item[17:].decode().startswith(str(home)):
                found[int(proc.name)] = Path(item[17:].decode())
    return found


def wait_spare(home: Path, not_in: set[int] = frozenset(), timeout: float = 180) -> int:
    """The pid of a spare that has imported TensorFlow (it says so by reading stdin: state S, in its log nothing
    yet), waiting for one to start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [pid for pid in spares(home) if pid not in not_in]
        if ready:
            return ready[0]
        time.sleep(0.2)
    raise AssertionError(f"no spare worker started under {home}")


def test_the_first_job_runs_on_the_spare_and_a_new_spare_follows(tmp_path: Path, digits) -> None:  # noqa: ANN001
    home = tmp_path / "home"
    with own_backend(home, AIBRO_SPARE_WORKER="1") as backend:
        client = backend.client()
        spare = wait_spare(home)
        assert client.policy().spare_worker is True
        x, y = digits[0][:256], digits[1][:256]
        job = Training(client).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, cool_down_period_s=600)
        )  # warm after it: a closed instance's folder goes (test_instance_leftovers.py), this one is looked at
        events = wait_for(client, job.job_id, _final)
        assert client.job(job.job_id).status == v.COMPLETED, events[-3:]
        inst = client.job(job.job_id).instance_id
        assert worker_process(instance_pid(home, inst)) == spare, "the job's worker is the spare started before it"
        workdir = (home / "state" / "workers" / inst).resolve()
        assert workdir.name.startswith("spare-") and (workdir / "worker.log").exists(), (
            "the instance's work directory (and log) is the spare's, under the instance's name"
        )
        deadline = time.monotonic() + 180
        while not [d for pid, d in spares(home).items() if pid != spare and d != workdir]:
            assert time.monotonic() < deadline, "no new spare followed the one used"
            time.sleep(0.2)


def test_a_spare_is_never_handed_to_another_user(tmp_path: Path, digits) -> None:  # noqa: ANN001
    home = tmp_path / "shared"
    with own_backend(home, AIBRO_SPARE_WORKER="1") as backend:
        bob = backend.add_user("bob")
        spare = wait_spare(home)  # started for the backend's own user, "local"
        x, y = digits[0][:128], digits[1][:128]
        job = Training(bob).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, cool_down_period_s=0)
        )
        wait_for(bob, job.job_id, _final)
        assert bob.job(job.job_id).status == v.COMPLETED
        assert worker_process(instance_pid(home, bob.job(job.job_id).instance_id)) != spare, (
            "bob's job got a worker of its own, not the spare started for the local user"
        )


def test_the_spare_goes_with_the_backend_and_the_knob_turns_it_off(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with own_backend(home, AIBRO_SPARE_WORKER="1") as backend:
        spare = wait_spare(home)
        backend.proc.send_signal(signal.SIGTERM)
        backend.proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while spare in spares(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert spare not in spares(home), "a stopped backend leaves no spare behind"

    off = tmp_path / "off"
    with own_backend(off, AIBRO_SPARE_WORKER="0") as backend:
        assert backend.client().policy().spare_worker is False
        time.sleep(3)  # a spare would have been started with the backend, before it listened
        assert spares(off) == {} and not list((off / "state" / "workers").glob("spare-*"))


def test_a_sigkilled_backend_leaves_no_spare(tmp_path: Path) -> None:
    """The spare waits on a pipe from the backend: the backend's death closes it and the spare exits."""
    home = tmp_path / "home"
    with own_backend(home, AIBRO_SPARE_WORKER="1") as backend:
        spare = wait_spare(home)
        os.kill(backend.pid, signal.SIGKILL)
        backend.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while spare in spares(home) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert spare not in spares(home)
