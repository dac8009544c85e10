"""Load benchmark: a real backend under a team's load, measured in one run.

Simulated workers (real processes speaking the worker API over HTTP, started by the backend's own local provider
through `AIBRO_WORKER_PYTHON`, so enrollment, assignment and tokens are the real ones) post epoch and batch
events as fast as the backend acknowledges them; watchers long-poll like kernels (`/jobs/{id}/events`) and
sidebars (`/events`); a prober calls `/health` every 50 ms. Users: several, each with jobs.

Printed side by side: events accepted per second (durable: acknowledged means committed), epoch-event → watcher
latency p50/p95, `/health` p50/p95/max, the backend's CPU seconds per 1,000 events, and (with `--profile`) where
the backend's time goes (py-spy, top functions).

Run: `python benchmarks/bench_load.py [--quick] [--profile]`. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core import vocabulary as v

HERE = Path(__file__).resolve()


# -- the simulated worker (runs as the backend's worker "interpreter") ---------------------------------------
def sim_worker() -> None:
    """Claim the assigned job, then post batches of events until the job is canceled, then say so."""
    from aibro_backend.worker.agent import worker_token
    from aibro_core.transport import Transport

    url = os.environ["AIBRO_WORKER_URL"]
    workdir = Path(os.environ.get("AIBRO_WORKER_DIR") or tempfile.mkdtemp())
    t = Transport(url, worker_token(url, os.environ, workdir), timeout=60)
    batch_size = int(os.environ.get("BENCH_BATCH", "50"))
    while True:
        a = t.json("GET", "/worker/assignment")
        if a["action"] == "exit":
            return
        if a["action"] == "train":
            break
        time.sleep(0.2)
    job_id, attempt = a["job_id"], a["attempt"]
    epochs = int(a["spec"]["fit"]["epochs"])
    wseq, epoch, step = 0, 0, 0
    cancel = False
    while not cancel and epoch < epochs:
        events = []
        for _ in range(batch_size - 1):
            wseq += 1
            step += 1
            events.append(
                {
                    "wseq": wseq,
                    "ts": time.time(),
                    "type": "batch",
                    "data": {"epoch": epoch, "batch": step, "logs": {"loss": 0.5}},
                }
            )
        wseq += 1
        events.append(
            {
                "wseq": wseq,
                "ts": time.time(),
                "type": "epoch",
                "data": {"epoch": epoch, "epochs": epochs, "logs": {"loss": 0.5, "accuracy": 0.9}, "seconds": 0.01},
            }
        )
        epoch += 1
        cancel = t.json("POST", f"/worker/jobs/{job_id}/events", json={"attempt": attempt, "events": events})["cancel"]
    t.json("POST", f"/worker/jobs/{job_id}/finish", json={"attempt": attempt, "outcome": "canceled"})


# -- the harness ------------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_backend(home: Path, workers: int) -> tuple[subprocess.Popen, str, str]:
    wrapper = home.parent / "sim-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE} --sim-worker\n")
    wrapper.chmod(0o755)
    env = {k: val for k, val in os.environ.items() if not k.startswith("AIBRO_") and k not in ("PYTHONPATH",)} | {
        "AIBRO_HOME": str(home),
        "AIBRO_WORKER_PYTHON": str(wrapper),
        "AIBRO_SANDBOX": "none",
        "AIBRO_LOCAL_CAPACITY": str(workers),
        "PYTHONPATH": str(HERE.parent.parent / "backend"),
    }
    log = open(home.parent / "backend.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            info = json.loads((home / "backend.json").read_text())
            token = json.loads((home / "credentials.json").read_text())["token"]
            if info.get("pid") == proc.pid:
                return proc, info["url"], token
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise SystemExit("the backend did not start; see " + str(home.parent / "backend.log"))


def add_user(home: Path, name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "aibro_backend.accounts", "add-user", name, "--home", str(home)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return next(word for word in out.split() if word.startswith("aibro_u_"))


async def run(args: argparse.Namespace, url: str, tokens: list[str], backend_pid: int) -> dict[str, Any]:
    import aiohttp

    from aibro_jupyter.blobsource import ArraySource
    from aibro_jupyter.client import BackendClient

    jobs: list[tuple[str, str]] = []  # (token, job_id)
    x = np.zeros((8, 4), "float32")
    for i in range(args.workers):
        token = tokens[i % len(tokens)]
        client = BackendClient(url, token)
        source = ArraySource(x)
        sha, _ = client.upload_source(source, source.sha256())
        spec = {
            "model": sha,
            "data": {"x": {"blob": sha}, "y": {"blob": sha}},
            "fit": {"epochs": 100000, "batch_size": 8},
            "machines": ["local-cpu"],
            "cool_down_s": 0,
        }
        jobs.append((token, client.submit(spec)["job_id"]))

    latencies: list[float] = []
    health: list[float] = []
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def job_watcher(token: str, job_id: str) -> None:
            after = 0
            headers = {"Authorization": f"Bearer {token}"}
            while not stop.is_set():
                async with session.get(
                    f"{url}/api/v1/jobs/{job_id}/events", params={"after": after, "wait": 20}, headers=headers
                ) as r:
                    page = await r.json()
                now = time.time()
                for e in page["events"]:
                    if e["type"] == "epoch" and measuring[0]:
                        latencies.append(now - e["ts"])
                if page["events"]:
                    after = page["events"][-1]["seq"]
                if page["status"] in v.JOB_FINAL:
                    return

        async def user_watcher(token: str) -> None:
            headers = {"Authorization": f"Bearer {token}"}
            async with session.get(f"{url}/api/v1/events", params={"after": 0}, headers=headers) as r:
                cursor = (await r.json())["cursor"]
            while not stop.is_set():
                async with session.get(
                    f"{url}/api/v1/events", params={"after": cursor, "wait": 20}, headers=headers
                ) as r:
                    cursor = (await r.json())["cursor"]

        async def prober() -> None:
            headers = {"Authorization": f"Bearer {tokens[0]}"}
            while not stop.is_set():
                t0 = time.monotonic()
                async with session.get(f"{url}/api/v1/health", headers=headers) as r:
                    await r.read()
                if measuring[0]:
                    health.append(time.monotonic() - t0)
                await asyncio.sleep(0.05)

        async def events_total() -> int:
            total = 0
            for token, job_id in jobs:
                async with session.get(
                    f"{url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}
                ) as r:
                    total += (await r.json()).get("epochs_done", 0)
            return total * args.batch

        measuring = [False]
        tasks = []
        for i in range(args.watchers):
            token, job_id = jobs[i % len(jobs)]
            if i % 10 == 9:
                tasks.append(asyncio.create_task(user_watcher(token)))
            else:
                tasks.append(asyncio.create_task(job_watcher(token, job_id)))
        tasks.append(asyncio.create_task(prober()))
        await asyncio.sleep(args.warmup)
        measuring[0] = True
        e0, c0, t0 = await events_total(), cpu_s(backend_pid), time.monotonic()
        await asyncio.sleep(args.seconds)
        e1, c1, t1 = await events_total(), cpu_s(backend_pid), time.monotonic()
        measuring[0] = False
        for token, job_id in jobs:
            async with session.post(
                f"{url}/api/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {token}"}
            ) as r:
                await r.read()
        stop.set()
        await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            task.cancel()
    events = e1 - e0
    return {
        "events_per_s": events / (t1 - t0),
        "events": events,
        "cpu_per_1000": 1000 * (c1 - c0) / max(events, 1),
        "latency": latencies,
        "health": health,
    }


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    if not shutil.which("py-spy"):
        print("(py-spy not installed: no profile)")
        return None
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--format", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def top_functions(raw: Path, n: int = 12) -> list[tuple[str, float]]:
    """Self time per function from py-spy's collapsed stacks (`frame;frame;leaf count`)."""
    leaf: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        name = frames[-1]
        leaf[name] = leaf.get(name, 0) + int(count)
    return [(name, c / total) for name, c in sorted(leaf.items(), key=lambda kv: -kv[1])[:n]]


def main() -> None:
    if "--sim-worker" in sys.argv:
        sim_worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer watchers, 10 s")
    parser.add_argument("--profile", action="store_true", help="py-spy the backend during the measurement")
    parser.add_argument("--keep", action="store_true", help="keep the temporary AIBRO_HOME")
    args = parser.parse_args()
    args.users = 10
    args.workers = 10 if args.quick else 20
    args.watchers = 200 if args.quick else 1000
    args.seconds = 10 if args.quick else 30
    args.warmup = 5
    args.batch = 50
    os.environ["BENCH_BATCH"] = str(args.batch)
    root = Path(tempfile.mkdtemp(prefix="aibro-bench-load-"))
    home = root / "home"
    home.mkdir()
    proc, url, admin = start_backend(home, args.workers)
    try:
        tokens = [add_user(home, f"user{i}") for i in range(args.users)]
        spy = profile(proc.pid, args.warmup + args.seconds, root / "profile.txt") if args.profile else None
        r = asyncio.run(run(args, url, tokens, proc.pid))
        if spy is not None:
            spy.wait(timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["pkill", "-f", f"{HERE} --sim-worker"], check=False)
    lat, hl = r["latency"], r["health"]
    rows = [
        ("users / jobs (simulated workers)", f"{args.users} / {args.workers}", ""),
        ("watchers (long-polls held)", f"{args.watchers}", "1000"),
        ("events accepted / s (durable)", f"{r['events_per_s']:.0f}", ">= 5000"),
        (
            "epoch event -> watcher p50 / p95 ms",
            f"{1000 * pct(lat, 0.5):.0f} / {1000 * pct(lat, 0.95):.0f}",
            "p95 <= 100",
        ),
        (
            "/health p50 / p95 / max ms",
            f"{1000 * pct(hl, 0.5):.0f} / {1000 * pct(hl, 0.95):.0f} / {1000 * max(hl or [0]):.0f}",
            "p95 <= 50",
        ),
        ("backend CPU s per 1,000 events", f"{r['cpu_per_1000']:.3f}", ""),
        ("cores on this machine", f"{os.cpu_count()}", ""),
    ]
    width = max(len(a) for a, _, _ in rows)
    print(f"\n{'load':<{width}}  {'measured':>18}  target")
    for name, got, target in rows:
        print(f"{name:<{width}}  {got:>18}  {target}")
    if args.profile and (root / "profile.txt").exists():
        print("\nbackend self time (py-spy):")
        for name, share in top_functions(root / "profile.txt"):
            print(f"  {100 * share:5.1f}%  {name}")
    print(f"\n{statistics.mean(lat) * 1000 if lat else float('nan'):.0f} ms mean latency over {len(lat)} epoch events")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
