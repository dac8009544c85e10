"""Ray provider benchmark, side by side in one run: gear-up on a Ray cluster (a new reservation vs a warm reuse,
with a new local worker as the yardstick) and the remote fit on a warm Ray instance over the same fit in-process.

Starts a throwaway cluster on this host (a head and one worker node of 1 CPU, as tests/ray_cluster.py does) and
a backend of its own with `--provider ray`, or uses `--ray-address` of a running cluster. Run:
`python benchmarks/bench_ray.py [--quick] [--ray-address HOST:PORT]`. See benchmarks/README.md.
"""

from __future__ import annotations

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the workers run with CUDA hidden too (the node has no GPU)

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from bench_foundation import (
    BATCH,
    SEED,
    Row,
    build_model,
    fit_span_s,
    kill_workers,
    local_fit,
    make_data,
    say,
    table,
    ts_of,
    wait_final,
)

from aibro_core.models import Job
from aibro_jupyter.client import BackendClient
from aibro_jupyter.training import Training

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ray_cluster import POOL, RayCluster  # noqa: E402 - the tests' throwaway cluster on this host

from aibro_jupyter.fitrequest import FitRequest

COOL_DOWN_S = 600


@contextlib.contextmanager
def cluster(address: str | None) -> Iterator[str]:
    """The cluster's address: the one given, or a head and one 1-CPU node started here (stopped after)."""
    if address:
        yield address
        return
    c = RayCluster()
    try:
        c.head()
        c.node("bench")
        say(f"ray start: {', '.join(f'{k} {val:.1f} s' for k, val in c.timings.items())}")
        yield c.address
    finally:
        c.stop()


@contextlib.contextmanager
def backend(home: Path, address: str, node_resource: str | None) -> Iterator[BackendClient]:
    """A backend of the benchmark's own with the Ray provider beside the local one."""
    cmd = [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0", "--provider", "ray"]
    cmd += ["--ray-address", address] + (["--ray-node-resource", node_resource] if node_resource else [])
    env = {k: val for k, val in os.environ.items() if k not in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    with open(home.with_name(home.name + ".log"), "ab") as log:
        proc = subprocess.Popen(cmd, env={**env, "AIBRO_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the backend exited: {home.with_name(home.name + '.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the backend did not start within 180 s")
            with contextlib.suppress(OSError, ValueError, KeyError):
                info = json.loads((home / "backend.json").read_text())
                token = json.loads((home / "credentials.json").read_text())["token"]
                if info.get("pid") == proc.pid:
                    break
            time.sleep(0.1)
        yield BackendClient(info["url"], token)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        kill_workers(home)


def job_on(client: BackendClient, machine: str, x: np.ndarray, y: np.ndarray, epochs: int) -> dict[str, Any]:
    job = Training(client).submit(
        FitRequest(
            build_model(SEED),
            x,
            y,
            machine_ids=machine,
            epochs=epochs,
            batch_size=BATCH,
            cool_down_period_s=COOL_DOWN_S,
        )
    )
    return wait_final(client, job.job_id)


def ready_s(job: Job) -> float:
    """Submit → the worker gearing up: the reservation (or reuse) and the agent reaching the backend."""
    return ts_of(job, "GEARING UP ENV") - job.created


def to_training_s(job: Job) -> float:
    """Submit → training: everything before the first batch (worker, environment, model and data)."""
    return ts_of(job, "TRAINING", "TRAINING") - job.created


def gear_rows(client: BackendClient) -> list[Row]:
    say("== gear-up: a new Ray reservation, a warm reuse, and a new local worker")
    x, y = make_data(512, seed=9)
    rows = []
    runs = [("ray-cpu1 new reservation", "ray-cpu1"), ("ray-cpu1 warm reuse", "ray-cpu1")]
    runs += [("local-cpu new worker", "local-cpu"), ("local-cpu warm reuse", "local-cpu")]
    for label, machine in runs:
        job = job_on(client, machine, x, y, epochs=1)
        say(f"{label}: {job['instance_id']} ready {ready_s(job):.2f} s, training after {to_training_s(job):.2f} s")
        rows.append(Row(f"{label}: submit → worker ready s", f"{ready_s(job):.2f}"))
        rows.append(Row(f"{label}: submit → training s", f"{to_training_s(job):.2f}"))
    return rows


def fit_rows(client: BackendClient, quick: bool) -> list[Row]:
    say("== remote fit on a warm ray-cpu1 instance vs in-process model.fit")
    x, y = make_data(20000, seed=SEED)
    probe = local_fit(x, y, 2, BATCH)["epoch_s"][-1]  # the second epoch: the first also traces the graph
    epochs = max(2, round((4.0 if quick else 15.0) / max(probe, 0.05)))
    local, remote = [], []
    for _ in range(2):  # alternate, best of two: other load lands in whichever run is going
        local.append(local_fit(x, y, epochs, BATCH)["fit_s"])
        remote.append(fit_span_s(job_on(client, "ray-cpu1", x, y, epochs)))
        say(f"in-process {local[-1]:.2f} s, remote on ray-cpu1 {remote[-1]:.2f} s ({epochs} epochs)")
    ratio = min(remote) / min(local)
    return [
        Row("in-process fit s (best of 2)", f"{min(local):.2f}"),
        Row("remote fit s on warm ray-cpu1 (best of 2)", f"{min(remote):.2f}"),
        Row("remote / in-process fit", f"{ratio:.2f}", "<= 1.05", ratio <= 1.05),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~4 s fits instead of ~15 s")
    parser.add_argument("--ray-address", default=None, help="a running cluster instead of a throwaway one")
    parser.add_argument("--node-resource", default=None, help="with --ray-address: only nodes with this resource")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="aibro-bench-ray-"))
    say(f"aibro Ray benchmark ({'quick' if args.quick else 'full'}), {os.cpu_count()} CPUs")
    rows: list[Row] = []
    try:
        with cluster(args.ray_address) as address:
            resource = args.node_resource if args.ray_address else POOL
            with backend(tmp / "home", address, resource) as client:
                rows += gear_rows(client)
                rows += fit_rows(client, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say()
    say(table(rows))
    say(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
