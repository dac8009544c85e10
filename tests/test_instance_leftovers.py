"""Issue 39 item 4, the three leftovers, replayed: a closed instance's folder is removed (and a restarted backend
removes those of instances that closed while it was down), worker folders are made 0700 whatever the umask, and a
backend of several users gives each job its share of the machine's memory by default, names that limit when a job
goes over it and shows it in `aibro backend status`."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import keras
import pytest
from backend_proc import own_backend
from greedy_layer import Greedy
from records import record

from aibro_backend.providers.local import LocalProvider, memory_bytes, pid_alive
from aibro_backend.scheduling.jobmemory import JobMemory
from aibro_backend.worker.joblimits import size_text
from aibro_core import vocabulary as v
from aibro_core.files import private_dir
from aibro_core.models import Machine
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import kill_workers, make_model
from helpers import aibro_cli, instance_pid, slow_data, user_data_config, wait_until

GiB = 2**30


def _modes(root: Path) -> dict[str, str]:
    """Every folder under `root` (itself included) whose mode is not 0700, by its path below `root`."""
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
    modes = {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in folders}
    return {path: mode for path, mode in modes.items() if mode != "0o700"}


def _instance_status(client: BackendClient, instance_id: str) -> str | None:
    return {i.id: i.status for i in client.instances()}.get(instance_id)


# -- 1. a closed instance's folder is removed ----------------------------------------------------------------------
def test_a_closed_instance_leaves_no_folder_only_its_log(client: BackendClient, aibro_home: Path) -> None:
    x, y = slow_data(500)
    trainer = Training(client)
    job = trainer.submit(
        FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, batch_size=64, cool_down_period_s=0)
    )
    assert trainer.watch(job.job_id).status == v.COMPLETED
    inst = client.job(job.job_id).instance_id
    folder = aibro_home / "state" / "workers" / inst
    kept = aibro_home / "state" / "worker-logs" / f"{inst}.log"
    assert wait_until(lambda: _instance_status(client, inst) == v.CLOSED, 120)
    assert wait_until(lambda: not folder.exists() and not folder.is_symlink(), 60), (
        f"{folder} still holds {sorted(p.name for p in folder.resolve().iterdir())}"
    )
    assert "aibro.worker" in kept.read_text(), "its worker's log is kept for the operator"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(kept.parent.stat().st_mode) == 0o700


def test_a_restarted_backend_removes_the_folders_of_instances_closed_while_it_was_down(tmp_path: Path) -> None:
    home = tmp_path / "home"
    x, y = slow_data(500)
    with own_backend(home) as backend:
        client = backend.client()
        trainer = Training(client)
        job = trainer.submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, batch_size=64, cool_down_period_s=600)
        )
        assert trainer.watch(job.job_id).status == v.COMPLETED
        inst = client.job(job.job_id).instance_id
        worker = instance_pid(home, inst)
        folder = home / "state" / "workers" / inst
        assert folder.is_dir() and pid_alive(worker), "its instance cools: its worker and folder are still in use"
        os.kill(backend.pid, signal.SIGKILL)  # the backend goes down without a word
        backend.proc.wait(timeout=60)
        kill_workers(home)  # and its instance's worker ends while it is down
        assert wait_until(lambda: not pid_alive(worker), 60)
    assert folder.is_dir(), "nothing removed the folder while the backend was down"
    with own_backend(home) as backend:
        assert wait_until(lambda: not folder.exists(), 120), "the restarted backend left the closed instance's folder"
        assert "aibro.worker" in (home / "state" / "worker-logs" / f"{inst}.log").read_text()
        assert wait_until(lambda: _instance_status(backend.client(), inst) == v.CLOSED, 60)


@pytest.mark.fast
def test_a_sweep_removes_all_but_live_workers_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalProvider.sweep on its own: the folders of live workers stay (a handed-over spare's under its link),
    every other goes with its worker.log kept aside; a log the job's code replaced by a link is not followed;
    logs kept over a week go; and alive() removes the folder of a worker it finds gone."""
    monkeypatch.setenv("AIBRO_SANDBOX", "none")
    state = tmp_path / "state"
    local = LocalProvider(state, capacity=2)
    workers, logs = private_dir(state / "workers"), state / "worker-logs"
    secret = tmp_path / "secret.txt"
    secret.write_text("the backend's own file")
    for name in ("inst-live", "inst-dead", "inst-closed", "spare-old", "spare-used", "inst-linked", "inst-adopted"):
        folder = private_dir(workers / name / "cache")
        (folder / "input.npy").write_bytes(b"data")
        (workers / name / "worker.log").write_text(f"{name} printed this")
    (workers / "inst-linked" / "worker.log").unlink()
    (workers / "inst-linked" / "worker.log").symlink_to(secret)  # what a job's code could leave in its folder
    (workers / "inst-warm").symlink_to("spare-used")  # a spare handed over, linked under its instance's name
    ended = subprocess.Popen(["true"])
    ended.wait()
    private_dir(logs)
    (logs / "inst-old.log").write_text("from last month")
    os.utime(logs / "inst-old.log", (time.time() - 8 * 86400,) * 2)
    live = {"inst-live": os.getpid(), "inst-warm": os.getpid(), "inst-dead": ended.pid, "inst-adopted": os.getpid()}

    assert local.sweep(live) == 4
    assert sorted(p.name for p in workers.iterdir()) == ["inst-adopted", "inst-live", "inst-warm", "spare-used"]
    assert {p.name: p.read_text() for p in logs.iterdir()} == {
        f"{name}.log": f"{name} printed this" for name in ("inst-dead", "inst-closed", "spare-old")
    }
    assert secret.read_text() == "the backend's own file", "the link was removed, never followed"
    assert _modes(logs) == {} and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in logs.iterdir())

    gone = dataclasses.replace(record("inst-adopted", "local-cpu", "local", v.COOLING), pid=ended.pid)
    assert local.alive(gone) is False and not (workers / "inst-adopted").exists()
    assert (logs / "inst-adopted.log").read_text() == "inst-adopted printed this"
    local.close()


# -- 2. worker folders are made 0700 -------------------------------------------------------------------------------
WORKER_FOLDERS = """
import json, os, sys
from pathlib import Path

os.umask(0o022)  # what a worker started by hand, or a Ray node's, may run under before the agent's own umask
from aibro_backend.providers.sandbox import Sandbox
from aibro_backend.worker.agent import Worker
from aibro_backend.worker.usercallbacks import snapshot
from aibro_backend.worker.usercode import UserCode

root = Path(sys.argv[1])
Sandbox("none", sys.executable).prepare(root / "state" / "workers" / "inst-1", None)  # the provider's side
work = root / "state" / "workers" / "inst-1"
worker = Worker("http://127.0.0.1:9", "aibro_w_x", "inst-1", work)  # its cache and code folders
blob = worker.cache / ("1" * 64)
blob.write_text(json.dumps({"files": {"pkg/sub/mod.py": "X = 1\\n"}, "modules": ["pkg.sub.mod"]}))
UserCode(blob, worker.code_root)  # the job's code, unpacked in folders of its own
(work / "out.txt").write_text("a callback's file")
snapshot(work / "out.txt", work / "returning" / "epoch-1")  # a copy on its way back to the kernel
"""


@pytest.mark.fast
def test_worker_folders_are_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WORKER_FOLDERS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "state" / "workers" / "inst-1"
    assert (work / "code" / ("1" * 64) / "pkg" / "sub" / "mod.py").exists(), "the code was unpacked"
    assert _modes(tmp_path / "state") == {}, "every folder made on the way, on either side, is 0700"


# -- 3. the memory each job may hold ------------------------------------------------------------------------------
def _machine(provider: str, memory_gib: float) -> Machine:
    return Machine(
        machine_id=f"{provider}-m",
        provider=provider,
        gpu_type=None,
        gpu_count=0,
        vcpus=4,
        memory_gib=memory_gib,
        price_per_hour=0.0,
        on_demand_price_per_hour=0.0,
        availability="available",
    )


@pytest.mark.fast
def test_the_memory_limit_is_a_shared_backends_share_unless_the_operator_sets_one() -> None:
    local, remote = _machine("local", 64.0), _machine("ray", 16.0)
    shared = JobMemory(setting=None, users=3, host_bytes=64 * GiB, local_slots=8)
    assert (shared.set_by, shared.limit(local), shared.limit(remote)) == ("share", 8 * GiB, 16 * GiB)
    assert shared.view()["local_bytes"] == 8 * GiB
    assert re.match(r"8\.0 GiB on this backend's host \(its 64\.0 GiB over 8 local slots\)", shared.view()["summary"])
    assert "AIBRO_JOB_MAX_MEMORY_BYTES" in shared.view()["summary"]
    alone = dataclasses.replace(shared, users=1)
    assert (alone.set_by, alone.limit(local), alone.limit(remote), alone.view()["local_bytes"]) == ("none", 0, 0, None)
    assert "not limited" in alone.view()["summary"] and "AIBRO_JOB_MAX_MEMORY_BYTES" in alone.view()["summary"]
    operator = dataclasses.replace(shared, setting=3 * GiB)
    assert (operator.set_by, operator.limit(local), operator.limit(remote)) == ("setting", 3 * GiB, 3 * GiB)
    assert operator.view()["summary"] == "3.0 GiB (AIBRO_JOB_MAX_MEMORY_BYTES)"
    off = dataclasses.replace(shared, setting=0)
    assert (off.set_by, off.limit(local)) == ("none", 0)
    assert off.view()["summary"] == "not limited (AIBRO_JOB_MAX_MEMORY_BYTES=0)"


@pytest.mark.fast
def test_a_cloud_machine_gets_its_jobs_memory_limit_in_its_user_data(tmp_path: Path) -> None:
    from aibro_backend.providers import shipping
    from aibro_backend.providers.aws import build_user_data, parse_user_data_env

    agent = shipping.served(tmp_path / "agent")
    cfg = user_data_config()
    token = "aibro_e_" + "x" * 32
    env = parse_user_data_env(build_user_data(cfg, "inst-1", token, agent, job_memory_bytes=16 * GiB))
    assert env["AIBRO_JOB_MAX_MEMORY_BYTES"] == str(16 * GiB)
    assert "AIBRO_JOB_MAX_MEMORY_BYTES" not in parse_user_data_env(build_user_data(cfg, "inst-1", token, agent))


def greedy_model(hold_mb: int) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), Greedy(hold_mb=hold_mb), *make_model().layers])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def test_a_shared_backend_holds_each_job_to_its_share_of_memory(tmp_path: Path) -> None:
    """No AIBRO_JOB_MAX_MEMORY_BYTES: alone, its user's jobs are not limited; once a second user is added, a job
    that holds more than its share (this host's memory over its local slots, made 1.5 GiB here by the slots) ends
    naming that limit and the setting, and `aibro backend status` shows it."""
    home = tmp_path / "home"
    slots = -(-memory_bytes() // (3 * GiB // 2))  # as many local slots as make a share of 1.5 GiB at most
    share = size_text(memory_bytes() // slots)
    with own_backend(home, AIBRO_LOCAL_CAPACITY=str(slots)) as backend:

        def status() -> str:
            done = aibro_cli(home, "backend", "status", AIBRO_BACKEND_URL=backend.url, AIBRO_TOKEN=backend.token)
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert "memory per job: not limited, as this backend has one user" in status()
        bob = backend.add_user("bob")
        assert f"memory per job: {share} on this backend's host" in status(), status()
        assert bob.health().job_memory.set_by == "share"

        x, y = slow_data(512)
        trainer = Training(bob)
        job = trainer.submit(FitRequest(greedy_model(1000), x, y, machine_ids="local-cpu", epochs=2, batch_size=64))
        view = trainer.watch(job.job_id)
        assert view.status == v.CANCELED, "the job held more than its share"
        named = rf"held .* of memory .* over its limit of {re.escape(share)} \(AIBRO_JOB_MAX_MEMORY_BYTES"
        assert view.errors and re.search(named, view.errors[-1]), view.errors
        assert "share of the machine" in view.errors[-1] and "operator" in view.errors[-1]
