"""Gear-up time per path on the AWS provider, measured through moto with played instances (issue 11 item 11).

Each round trains three short jobs on one on-demand machine id and times how long each spent before training,
per substatus, from its timeline:
  new      - a fresh launch (run_instances, boot, enrollment, agent, environment);
  cooling  - the next job on the still-warm instance (no launch at all);
  stopped  - a job after the instance's cool-down ended and it was STOPPED (start_instances, agent returns).
Printed side by side (median over rounds), with the parts only a real AWS account can give.

With `--first-boot`, a new launch is also timed as a bare machine really boots (tests/firstboot.py: the user data
run as root in bubblewrap with the system's Python and no aibro, pip from a local wheelhouse): power-on to the
agent installed, to enrolled, to the job trained, beside the played launch (a warm Python: the ceiling).

Run: `python benchmarks/bench_aws_gearup.py [--rounds N] [--first-boot] [--keep]`. Needs moto[server] (and
bubblewrap and root for --first-boot). See benchmarks/README.md.
"""

from __future__ import annotations

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from aws_moto import PlayedInstances, make_account, moto_server, write_config  # noqa: E402 - the tests' harness
from backend_proc import own_backend  # noqa: E402

from aibro_backend.providers.aws_config import load_aws_config  # noqa: E402
from aibro_core import vocabulary as v  # noqa: E402
from aibro_jupyter.client import BackendClient  # noqa: E402
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.timeline_table import per_substatus  # noqa: E402
from aibro_jupyter.training import Training  # noqa: E402

# One on-demand type per round, so each round's first job is a new launch (not a restart of the last round's).
TYPES = ("g4dn.xlarge.od", "g4dn.2xlarge.od", "g5.xlarge.od", "g5.2xlarge.od", "g6.xlarge.od", "p3.2xlarge.od")
PATHS = ("new", "cooling", "stopped")
PARTS = (
    ("REQUESTING", v.REQUESTING_SERVER),
    ("CONNECTING", v.CONNECTING_SERVER),
    ("GEARING UP ENV", v.GEARING_UP_ENV),
    ("SENDING", v.SENDING_MODEL_DATA),
)
REAL_ONLY = """Only a real account gives (moto marks an instance `running` at once and the harness starts the agent as a
local process as soon as it sees it, with this host's warm Python):
  * boot time of a real instance: pending -> running (typically 10-60 s for GPU types) and the OS boot to the
    agent's systemd unit; here CONNECTING is the harness's poll (0.2 s) plus a Python process start;
  * the AMI's first use: EBS lazily pulling the snapshot's blocks (first reads of TF/CUDA libraries can add tens
    of seconds to GEARING UP ENV on a new launch), and a pip install of the job's requirements over the network;
  * real start_instances latency for a stopped instance (stopped -> running, then boot again), and the stop
    itself (stopping -> stopped) that must finish before a restart is possible;
  * spot capacity and price: a real launch can be refused (InsufficientInstanceCapacity) and pass over.
What moto does measure: the backend's own path (scheduling, boto3 calls through an executor, enrollment, the
agent's setup and environment reuse), so a regression in our code shows here."""


def model() -> Any:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def wait_instance(client: BackendClient, instance_id: str, state: tuple[str, str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inst = {i.id: i for i in client.instances()}[instance_id]
        if (inst.status, inst.substatus) == state:
            return
        time.sleep(0.25)
    raise SystemExit(f"{instance_id} never reached {state}")


def run_job(tr: Training, machine: str, cool_down: float, x: Any, y: Any) -> dict[str, Any]:
    job = tr.submit(
        FitRequest(model(), x, y, machine_ids=machine, epochs=1, batch_size=64, cool_down_period_s=cool_down)
    )
    view = tr.watch(job.job_id)
    if view.status != v.COMPLETED:
        raise SystemExit(f"{job.job_id} ended {view.status}: {view.errors}")
    done = tr.client.job(job.job_id)
    done.price_per_hour = {i.id: i for i in tr.client.instances()}[done.instance_id].price_per_hour
    return done


def round_trip(tr: Training, machine: str, x: Any, y: Any) -> dict[str, dict[str, Any]]:
    """new launch (kept warm), warm reuse (then stopped after 1 s of cooling), restart of the stopped machine."""
    new = run_job(tr, machine, 120, x, y)
    warm = run_job(tr, machine, 1, x, y)
    wait_instance(tr.client, warm.instance_id, (v.CLOSED, v.STOPPED))
    restarted = run_job(tr, machine, 0, x, y)
    assert new.instance_id == warm.instance_id == restarted.instance_id, "one instance per round"
    return {"new": new, "cooling": warm, "stopped": restarted}


def table(rounds: list[dict[str, dict[str, Any]]]) -> str:
    def med(path: str, sub: str | None) -> float:
        vals = []
        for r in rounds:
            spent = per_substatus(r[path]["timeline"])
            vals.append(sum(spent.get(s, 0.0) for _, s in PARTS) if sub is None else spent.get(sub, 0.0))
        return statistics.median(vals)

    lines = [f"| gear-up (median of {len(rounds)}, s) | " + " | ".join(PATHS) + " |", "|---|" + "---:|" * len(PATHS)]
    for label, sub in PARTS:
        lines.append(f"| {label} | " + " | ".join(f"{med(p, sub):.2f}" for p in PATHS) + " |")
    lines.append("| **total before TRAINING** | " + " | ".join(f"**{med(p, None):.2f}**" for p in PATHS) + " |")
    billed = [statistics.median(r[p]["cost"] / r[p]["price_per_hour"] * 3600 for r in rounds) for p in PATHS]
    lines.append("| job's billed seconds (cost / price) | " + " | ".join(f"{b:.1f}" for b in billed) + " |")
    return "\n".join(lines)


def first_boot(root: Path, aws_env: dict[str, str], x: Any, y: Any) -> list[str]:
    """One new launch on a bare machine (tests/firstboot.py), timed from power-on; returns the table's lines."""
    import base64
    from urllib.parse import urlsplit

    import boto3
    import firstboot
    import wheelhouse
    from aws_moto import REGION

    from aibro_backend.providers import shipping

    why = firstboot.usable()
    if why:
        return [f"first boot not measured: {why}"]
    t0 = time.monotonic()
    wheelhouse.build(list(shipping.AGENT_REQUIRES), root / "wheels")
    packed = time.monotonic() - t0
    public = "http://backend.aibro.test:8888"
    config = write_config(root / "boot.toml", make_account(), backend_public_url=public)
    backend_id = load_aws_config(config).backend_id
    with own_backend(root / "boot-home", "--provider", "aws", "--aws-config", str(config), **aws_env) as b:
        tr = Training(b.client())
        job = tr.submit(FitRequest(model(), x, y, machine_ids="g4dn.xlarge.od", epochs=1, batch_size=64))
        ec2 = boto3.Session(region_name=REGION).client("ec2")
        user_data = ""
        while not user_data:
            pages = ec2.describe_instances(Filters=[{"Name": "tag:aibro:backend", "Values": [backend_id]}])
            for inst in (i for r in pages["Reservations"] for i in r["Instances"]):
                raw = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")
                user_data = base64.b64decode(raw["UserData"]["Value"]).decode()
            time.sleep(0.2)
        s3 = int(urlsplit(aws_env["AWS_ENDPOINT_URL"]).port or 0)
        routes = {8888: int(urlsplit(b.url).port or 0), s3: s3}
        machine = firstboot.Machine(root / "machine", root / "wheels", ["backend.aibro.test"], routes)
        try:
            on = time.time()
            machine.boot(user_data)
            view = tr.watch(job.job_id)
            trained = time.time() - on
            installed = (machine.disk["/opt/aibro"] / "agent-version").stat().st_mtime - on
            enrolled = next((ln for ln in machine.log("aibro-worker.log").splitlines() if "enrolled as" in ln), "")[:23]
            enrolled_s = time.mktime(time.strptime(enrolled[:19], "%Y-%m-%d %H:%M:%S")) + float(enrolled[20:23]) / 1000
            spent = per_substatus(tr.client.job(job.job_id).timeline)
        finally:
            machine.close()
    if view.status != v.COMPLETED:
        return [f"first boot: the job ended {view.status}: {view.errors}"]
    return [
        "| first boot of a bare machine (s from power-on) | seconds |",
        "|---|---:|",
        f"| agent downloaded, checked and installed (with TensorFlow from the wheelhouse) | {installed:.1f} |",
        f"| enrolled | {enrolled_s - on:.1f} |",
        f"| job trained (1 epoch) | {trained:.1f} |",
        f"| of which GEARING UP ENV (job timeline) | {spent.get(v.GEARING_UP_ENV, 0.0):.2f} |",
        f"(the wheelhouse, {packed:.0f} s to pack, stands in for the image's package mirror)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help=f"rounds of new/cooling/stopped (at most {len(TYPES)})")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (backend and agent logs)")
    ap.add_argument("--first-boot", action="store_true", help="also time a bare machine's real first boot")
    args = ap.parse_args()
    rounds_n = max(1, min(args.rounds, len(TYPES)))
    root = Path(tempfile.mkdtemp(prefix="aibro-bench-aws-"))
    rng = np.random.default_rng(0)
    x, y = rng.random((2000, 64), dtype=np.float32), rng.integers(0, 10, 2000).astype("int32")
    try:
        with moto_server() as aws_env:
            config = write_config(root / "aws.toml", make_account())
            backend_id = load_aws_config(config).backend_id
            with own_backend(root / "home", "--provider", "aws", "--aws-config", str(config), **aws_env) as b:
                with PlayedInstances(backend_id, b.url, root / "machines", aws_env):
                    tr = Training(b.client())
                    rounds = []
                    for machine in TYPES[:rounds_n]:
                        rounds.append(round_trip(tr, machine, x, y))
                        print(f"round on {machine}: done", flush=True)
            boot = first_boot(root, aws_env, x, y) if args.first_boot else []
        print()
        print(table(rounds))
        if boot:
            print()
            print("\n".join(boot))
        print()
        print(REAL_ONLY)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
