"""The backend with the Ray provider on (issue 12), against a real Ray cluster on this host (tests/ray_cluster.py:
a head and two worker nodes of 1 CPU each; node b also says it has 1 GPU, which Ray takes as given), through a
real backend process (`--provider ray --ray-address ADDRESS`): a refused address, online_fit on ray-cpu1 to
COMPLETED, a `%%cloud_fit` cell in a real kernel training on ray-cpu1 unchanged (issue 12 item 6), three jobs
over two nodes (placement in the instances view; the third waits with the cluster's words), a hyperparameter
study's trials as jobs over both nodes (issue 27), a job waiting for a
GPU passed over to its fallback after wait_request_s, a killed node resumed from the last checkpoint on the other
node with every epoch once, and `ray stop` of the whole cluster failing the job with the cluster named. The
cluster and the backend are started once for the module (each `ray start` is slow here); the cluster-stopping
test runs last."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from backend_proc import OwnBackend, own_backend
from kernel_helpers import digits_setup, run_cell, start_kernel
from ray_cluster import POOL, RayCluster, free_port, ray_available, start_cluster

from aibro_core import vocabulary as v
from aibro_core.models import Instance
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import epochs_seen, slow_data, user_env, wait_for

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with start_cluster({"a": {}, "b": {"gpus": 1}}) as c:
        yield c


@pytest.fixture(scope="module")
def backend(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBackend]:
    home = tmp_path_factory.mktemp("ray-backend") / "home"
    args = ("--provider", "ray", "--ray-address", cluster.address, "--ray-node-resource", POOL)
    with own_backend(home, *args) as b:
        yield b


def until(what: str, cond: Callable[[], Any], timeout: float = 240.0) -> Any:
    """`cond()`'s first true value; fails naming `what` after `timeout` (generous: 2 shared cores)."""
    deadline = time.monotonic() + timeout
    while True:
        found = cond()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(0.3)


def instance(client: BackendClient, instance_id: str) -> Instance:
    return {i.id: i for i in client.instances()}[instance_id]


def last_status_message(client: BackendClient, job_id: str) -> str:
    events = client.events(job_id, 0)["events"]
    return [e["data"].get("message", "") for e in events if e["type"] == v.EV_STATUS][-1]


def final(events: list[dict[str, Any]]) -> bool:
    return any(e["type"] == v.EV_STATUS and e["data"]["status"] in (v.COMPLETED, v.CANCELED) for e in events)


def node_of(cluster: RayCluster, instance_id: str) -> str:
    """The node (its `ray start` session) whose Ray worker started this instance's agent, found from /proc: the
    process whose environment names the instance, then up its parents to a process of a node's session."""
    marker = f"AIBRO_INSTANCE_ID={instance_id}".encode()
    sessions = {sid: name for name, sid in cluster.sessions.items()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        pid = int(proc.name)
        while pid > 1:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                break
            if int(stat[3]) in sessions:
                return sessions[int(stat[3])]
            pid = int(stat[1])
    pytest.fail(f"no process of {instance_id} under a node of the cluster")


def test_an_unreachable_address_is_refused_before_listening(tmp_path: Path) -> None:
    ray_available()
    address = f"127.0.0.1:{free_port()}"
    home = tmp_path / "home"
    home.mkdir()
    cmd = [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0", "--provider", "ray"]
    done = subprocess.run([*cmd, "--ray-address", address], env=user_env(home), capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the Ray cluster at {address}" in done.stderr and "ray start --head" in done.stderr, done.stderr
    assert not (home / "backend.json").exists(), "it never listened"
    missing = subprocess.run(cmd, env=user_env(home), capture_output=True, text=True)
    assert missing.returncode == 2 and "--provider ray needs --ray-address" in missing.stderr, missing.stderr
    cli = [sys.executable, "-m", "aibro_jupyter.cli", "backend", "serve", "--provider", "ray"]
    via_cli = subprocess.run([*cli, "--ray-address", address], env=user_env(home), capture_output=True, text=True)
    assert via_cli.returncode == 2 and address in via_cli.stderr, via_cli.stderr


def test_online_fit_on_ray_cpu1_completes_on_a_node(
    backend: OwnBackend, cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    client = backend.client()
    machines = {m.machine_id: m for m in client.machines()}
    assert machines["local-cpu"].provider == "local", "the local provider stays on beside Ray"
    assert machines["ray-cpu1"].provider == "ray" and machines["ray-cpu1"].capacity == 2
    assert machines["ray-gpu1"].gpu_count == 1 and machines["ray-gpu1"].price_per_hour == 0.0
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(400)
    model = make_model()
    before = [w.copy() for w in model.get_weights()]
    job_id, trained, history = Training.online_fit(
        model, x, y, machine_ids="ray-cpu1", batch_size=32, epochs=2, description="on ray", record=False
    )
    assert trained is model and len(history.history["loss"]) == 2
    assert any(not np.allclose(a, c) for a, c in zip(before, model.get_weights()))
    job = client.job(job_id)
    assert job.status == v.COMPLETED and job.machine_id == "ray-cpu1"
    inst = instance(client, job.instance_id)
    assert inst.provider == "ray" and [h[0] for h in inst.history][:2] == [v.LAUNCHING, v.EXECUTING]
    until("the instance closed (no cool-down)", lambda: instance(client, job.instance_id).status == v.CLOSED)
    until("both CPUs free", lambda: {m.machine_id: m for m in client.machines()}["ray-cpu1"].available == 2)


def test_a_study_runs_its_trials_as_jobs_on_both_nodes(
    backend: OwnBackend, cluster: RayCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 27 item 6: a 4-trial RandomSearch, two trials at once, on ray-cpu1: each trial a job whose model the
    node builds with the travelling build function; two run at once, so on both nodes (1 CPU each)."""
    import keras_tuner as kt
    from searchmodels import build_model

    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(400)
    xv, yv = slow_data(100, seed=2)
    tuner = kt.RandomSearch(
        build_model, objective="val_accuracy", max_trials=4, seed=5, directory=str(tmp_path), project_name="ray"
    )
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="ray-cpu1", parallel=2, epochs=2, batch_size=32, validation_data=(xv, yv)
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED" and [t["status"] for t in study["trials"]] == ["COMPLETED"] * 4, study
    jobs = [client.job(t["job_id"]) for t in study["trials"]]
    assert all(j.machine_id == "ray-cpu1" for j in jobs)
    spans = sorted(
        (
            next(e.ts for e in j.timeline if e.substatus == v.GEARING_UP_ENV),
            max(e.ts or 0 for e in j.timeline),
        )
        for j in jobs
    )
    # Two held a machine at once (from gearing up, on it, to their end; their fits alone are too short to compare
    # under load); each node has one CPU, so they were on both nodes.
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert best is not None and tuner.get_best_hyperparameters()[0].values == next(
        t["values"] for t in study["trials"] if t["trial_id"] == study["best_trial_id"]
    )
    until("both CPUs free", lambda: {m.machine_id: m for m in client.machines()}["ray-cpu1"].available == 2)


UNTRAINED = 'model = build()\nprint("UNTRAINED", round(model.evaluate(x_val, y_val, verbose=0)[1], 4))'
KERNEL_SETUP = digits_setup(then=UNTRAINED)
KERNEL_FIT = """%%cloud_fit --machine ray-cpu1 --cool-down 60 --description "kernel on ray"
history = model.fit(x_train, y_train, epochs=4, batch_size=32, validation_data=(x_val, y_val))
acc = model.evaluate(x_val, y_val, verbose=0)[1]
print("FINAL", round(acc, 4), round(history.history["val_accuracy"][-1], 4))
"""


def test_cloud_fit_in_a_kernel_trains_on_a_ray_machine_unchanged(
    backend: OwnBackend, cluster: RayCluster, tmp_path: Path
) -> None:
    """Issue 12 item 6: the magics as a notebook user runs them, with nothing Ray-specific but the machine id."""
    client = backend.client()
    env = {"AIBRO_HOME": str(tmp_path / "kernel-home"), "AIBRO_BACKEND_URL": backend.url, "AIBRO_TOKEN": backend.token}
    km, kc = start_kernel(env, cwd=str(tmp_path))
    try:
        setup = run_cell(kc, KERNEL_SETUP, timeout=300)
        assert not setup.error, setup.error
        untrained = float(re.search(r"UNTRAINED (\S+)", setup.stdout).group(1))  # type: ignore[union-attr]
        listed = run_cell(kc, "%cloud_machines", timeout=120)
        assert not listed.error, listed.error
        rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[2:] if line.strip()}
        assert rows["ray-cpu1"][1] == "ray" and rows["ray-gpu1"][1] == "ray", listed.stdout
        assert rows["local-cpu"][1] == "local", listed.stdout
        res = run_cell(kc, KERNEL_FIT, timeout=600)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not res.error, res.error + res.stdout[-3000:]
    for k in range(1, 5):
        assert res.stdout.count(f"Epoch {k}/4 ") == 1, res.stdout
    final = re.search(r"FINAL (\S+) (\S+)", res.stdout)
    assert final, res.stdout
    assert res.stdout.index("FINAL") > res.stdout.index("Epoch 4/4 "), "the code after the fit ran after it"
    assert final.group(1) == final.group(2), f"the trained weights came back into `model`: {res.stdout}"
    assert float(final.group(1)) > max(0.5, untrained + 0.2), (untrained, res.stdout)
    job = next(j for j in reversed(client.jobs()) if j.description == "kernel on ray")
    assert (job.status, job.machine_id, job.meta) == (v.COMPLETED, "ray-cpu1", {"variable": "model"}), job
    inst = instance(client, job.instance_id)
    assert inst.provider == "ray" and inst.machine_id == "ray-cpu1", inst
    placed = inst.placement
    assert placed["node_id"] and placed["node_ip"] and placed["ray_address"] == cluster.address, placed
    # The cool-down keeps the reservation: the instance cools on its node, holding one of the two CPUs.
    until("the instance cooling", lambda: instance(client, job.instance_id).status == v.COOLING, 60)
    assert node_of(cluster, job.instance_id) in {"a", "b"}
    until(
        "one CPU held while cooling",
        lambda: {m.machine_id: m for m in client.machines()}["ray-cpu1"].available == 1,
    )
    client.terminate(job.instance_id)
    until("the instance closed", lambda: instance(client, job.instance_id).status == v.CLOSED)
    until("both CPUs free", lambda: {m.machine_id: m for m in client.machines()}["ray-cpu1"].available == 2)


def test_three_jobs_spread_over_two_nodes_and_the_third_waits_with_the_clusters_words(
    backend: OwnBackend, cluster: RayCluster
) -> None:
    client = backend.client()
    x, y = slow_data(3000)
    training = Training(client)
    jobs = [
        training.submit(
            FitRequest(make_model(), x, y, machine_ids="ray-cpu1", batch_size=16, epochs=8, description=f"spread {k}")
        )
        for k in range(3)
    ]
    ids = [j.job_id for j in jobs]

    def training_now() -> list[str]:
        return [j for j in ids if client.job(j).status == v.TRAINING]

    running = until("two jobs training", lambda: (lambda t: t if len(t) == 2 else None)(training_now()))
    (waiting,) = [j for j in ids if j not in running]
    job = client.job(waiting)
    assert (job.status, job.substatus) == (v.QUEUING, v.REQUESTING_SERVER)
    assert last_status_message(client, waiting) == f"waiting for 1 CPU on the Ray cluster ({cluster.address})"
    # A job that lists a fallback does not wait: the local machine takes it at once.
    fallback = training.submit(
        FitRequest(make_model(), x[:200], y[:200], machine_ids=["ray-cpu1", "local-cpu"], epochs=1)
    )
    until("the fallback on local-cpu", lambda: client.job(fallback.job_id).machine_id == "local-cpu", 60)
    placed = [instance(client, client.job(j).instance_id).placement for j in running]
    assert all(p["node_id"] and p["node_ip"] and p["ray_address"] == cluster.address for p in placed), placed
    assert placed[0]["node_id"] != placed[1]["node_id"], "one per node: each node has 1 CPU"
    assert {node_of(cluster, client.job(j).instance_id) for j in running} == {"a", "b"}
    for j in ids:
        events = wait_for(client, j, final, timeout=600)
        assert client.job(j).status == v.COMPLETED, events[-5:]
        assert epochs_seen(events) == list(range(8))
    wait_for(client, fallback.job_id, final, timeout=600)


def test_a_job_waiting_for_a_gpu_says_so_then_passes_over_after_wait_request_s(
    backend: OwnBackend, cluster: RayCluster
) -> None:
    """Node b (the only one with a GPU) is busy with a CPU job: the GPU job's instance is launched but Ray cannot
    place it; the job stays QUEUING · REQUESTING SERVER with the provider's words until wait_request_s, then
    goes on to the next machine in its list."""
    client = backend.client()
    x, y = slow_data(3000)
    training = Training(client)
    busy = [
        training.submit(
            FitRequest(make_model(), x, y, machine_ids="ray-cpu1", batch_size=16, epochs=80, description=f"busy {k}")
        )
        for k in range(2)
    ]
    # Long (canceled below): a busy job that ended early would free node b and let Ray place the GPU job.
    until("both nodes busy", lambda: all(client.job(j.job_id).status == v.TRAINING for j in busy))
    gpu = training.submit(
        FitRequest(make_model(), x[:200], y[:200], machine_ids=["ray-gpu1", "local-cpu"], epochs=1, wait_request_s=20)
    )
    said = f"waiting for 1 GPU on the Ray cluster ({cluster.address})"
    until("the GPU job waiting", lambda: last_status_message(client, gpu.job_id) == said, 60)
    job = client.job(gpu.job_id)
    assert (job.status, job.substatus, job.machine_id) == (v.QUEUING, v.REQUESTING_SERVER, "ray-gpu1")
    assert instance(client, job.instance_id).placement["waiting"] == said
    until("passed over to local-cpu", lambda: client.job(gpu.job_id).machine_id == "local-cpu", 120)
    logs = [e["data"]["message"] for e in client.events(gpu.job_id, 0)["events"] if e["type"] == v.EV_LOG]
    assert any("ray-gpu1 was not ready within 20 s" in m and said in m for m in logs), logs
    for j in [gpu, *busy]:
        client.cancel(j.job_id)
    for j in [gpu, *busy]:
        wait_for(client, j.job_id, final, timeout=300)
    until("both CPUs free", lambda: {m.machine_id: m for m in client.machines()}["ray-cpu1"].available == 2)


def test_killing_the_node_resumes_on_the_other_one_with_every_epoch_once(
    backend: OwnBackend, cluster: RayCluster
) -> None:
    client = backend.client()
    x, y = slow_data(3000)
    epochs = 16  # enough left after the kill that the job cannot finish before its node's loss is noticed
    job_id = (
        Training(client)
        .submit(
            FitRequest(
                make_model(), x, y, machine_ids="ray-cpu1", batch_size=16, epochs=epochs, description="node killed"
            )
        )
        .job_id
    )
    wait_for(client, job_id, lambda evs: len(epochs_seen(evs)) >= 2, timeout=600)
    first = client.job(job_id).instance_id
    doomed = node_of(cluster, first)
    cluster.kill(doomed)  # SIGKILL to the node's `ray start` process group
    events = wait_for(client, job_id, final, timeout=600)
    job = client.job(job_id)
    assert job.status == v.COMPLETED, events[-5:]
    assert epochs_seen(events) == list(range(epochs)), "every epoch exactly once, in order"
    assert job.attempt == 1 and job.instance_id != first
    resumed = [
        e["data"]["message"] for e in events if e["type"] == v.EV_LOG and "resuming from" in e["data"]["message"]
    ]
    # Which the backend notices first on a loaded box, the node's loss or its worker's SIGKILL, is a race: both say
    # why the worker went, and either way the job resumes from its checkpoint on the other node.
    assert resumed and ("the Ray node" in resumed[0] or "exited with code -9" in resumed[0]), resumed


def test_ray_stop_fails_the_job_naming_the_cluster(backend: OwnBackend, cluster: RayCluster) -> None:
    """Last: it stops the module's cluster (SIGTERM to every node, as `ray stop` does on each host)."""
    client = backend.client()
    x, y = slow_data(3000)
    # Far more epochs than the node's workers take to notice their raylet is gone, even on a loaded box: a worker
    # that outlives the cluster long enough to finish would rightly complete the job.
    job_id = (
        Training(client)
        .submit(
            FitRequest(
                make_model(), x, y, machine_ids="ray-cpu1", batch_size=16, epochs=500, description="cluster stopped"
            )
        )
        .job_id
    )
    wait_for(client, job_id, lambda evs: len(epochs_seen(evs)) >= 1, timeout=600)
    for name in list(cluster.sessions):
        cluster.kill(name, signal.SIGTERM)
    events = wait_for(client, job_id, final, timeout=120)
    job = client.job(job_id)
    assert job.status == v.CANCELED, events[-5:]
    assert f"the Ray cluster at {cluster.address}" in (job.error or ""), job.error
    assert "start the cluster again" in job.error
    machines = {m.machine_id: m for m in client.machines()}
    assert machines["ray-cpu1"].availability == "unreachable" and machines["ray-cpu1"].available == 0
    # A job submitted now fails at once with the same words; the local provider still trains.
    later = Training(client).submit(FitRequest(make_model(), x[:100], y[:100], machine_ids="ray-cpu1", epochs=1))
    wait_for(client, later.job_id, final, timeout=60)
    assert cluster.address in (client.job(later.job_id).error or "")
    assert os.path.exists(backend.home / "backend.json"), "the backend itself stays up"
