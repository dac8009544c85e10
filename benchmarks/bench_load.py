"""Load benchmark: a real backend under a team's load, measured in one run.

Simulated workers (real processes speaking the worker API over HTTP, started by the backend's own local provider
through `AIBRO_WORKER_PYTHON`, so enrollment, assignment and tokens are the real ones) post batches of epoch and
batch events; watchers long-poll like kernels (`/jobs/{id}/events`) and sidebars (`/events`) from processes of
their own, over a lean HTTP client so that they cost the machine less than the backend they measure; a prober
calls `/health` every 50 ms. Ten users each submit the policy's five active jobs: two train, the rest queue.

Two windows, printed side by side: a held window where the workers offer a fixed rate (5,000 events/s by default)
and the latency and /health targets are judged, then a flat-out window (each worker posts as fast as it is
acknowledged) that gives the capacity. For each: events accepted per second (durable: acknowledged means
committed to the log with synchronous=FULL), epoch-event → watcher latency p50/p95, `/health` p50/p95/max, the
backend's CPU seconds per 1,000 events and the load generator's CPU, and (with `--profile`) where the backend's
time goes (py-spy: by part, and the top functions).

Run: `python benchmarks/bench_load.py [--quick] [--profile] [--rate N]`. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core import vocabulary as v
from aibro_core.models import JobSpec

HERE = Path(__file__).resolve()
# The load generator (watchers, simulated workers) runs at this niceness: on a small machine the backend then gets
# the CPU it would have on a host of its own, where kernels, sidebars and workers are elsewhere. 0 with --same-priority.
GENERATOR_NICE = 10


# -- the simulated worker (runs as the backend's worker "interpreter") ---------------------------------------
def sim_worker() -> None:
    """Claim the assigned job, then post batches of events at the rate the harness sets (BENCH_CONTROL: events per
    second for this worker, 0 = as fast as the backend acknowledges) until the job is canceled, then say so."""
    from aibro_backend.worker.agent import worker_token
    from aibro_core.transport import Transport

    url = os.environ["AIBRO_WORKER_URL"]
    workdir = Path(os.environ.get("AIBRO_WORKER_DIR") or tempfile.mkdtemp())
    t = Transport(url, worker_token(url, os.environ, workdir), timeout=60)
    batch_size = int(os.environ.get("BENCH_BATCH", "50"))
    control = Path(os.environ["BENCH_CONTROL"])
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
    rate, read_at, due = 0.0, 0.0, time.monotonic() + random.random() * 0.2  # spread the workers' phases
    while not cancel and epoch < epochs:
        now = time.monotonic()
        if now - read_at > 0.5:
            rate, read_at = float(control.read_text() or 0), now
        if rate > 0:
            due = max(due, now - 1.0)  # a worker that fell behind catches up by at most a second's worth
            if due > now:
                time.sleep(due - now)
            due += batch_size / rate
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


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def generator_cpu_s(watcher_pids: list[int]) -> tuple[float, float, float]:
    """CPU seconds of the load generator's parts: the watcher processes, every simulated worker, this process."""
    workers = subprocess.run(["pgrep", "-f", f"{HERE} --sim-worker"], capture_output=True, text=True).stdout.split()

    def of(pids: list[Any]) -> float:
        total = 0.0
        for pid in pids:
            try:
                total += cpu_s(int(pid))
            except (OSError, ValueError, IndexError):
                pass  # it ended between the listing and the read
        return total

    return of(watcher_pids), of(workers), sum(os.times()[:2])


def start_backend(home: Path, workers: int, nice: int) -> tuple[subprocess.Popen, str, str]:
    wrapper = home.parent / "sim-python"
    # the local provider hands workers a clean environment: the wrapper carries the benchmark's own settings
    settings = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("BENCH_BATCH", "BENCH_CONTROL"))
    wrapper.write_text(f"#!/bin/sh\nexec nice -n {nice} env {settings} {sys.executable} {HERE} --sim-worker\n")
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
        [sys.executable, "-m", "aibro_backend.server.accounts", "add-user", name, "--home", str(home)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return next(word for word in out.split() if word.startswith("aibro_u_"))


# -- a lean HTTP/1.1 client: the watchers must cost the machine far less than the backend they measure -----------
class Conn:
    """One keep-alive connection making one request at a time (what a long-polling kernel or sidebar holds)."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.split("://", 1)[1].partition(":")
        self.port = int(port.rstrip("/"))
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, token: str) -> Any:
        body = await self.raw(method, path, token)
        return json.loads(body) if body else None

    async def raw(self, method: str, path: str, token: str) -> bytes:
        """The answer's body as bytes (a watcher reads only what it needs from it)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            f"{method} /api/v1{path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: 0\r\n\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        body = await self.reader.readexactly(int(found.group(1))) if found else b""
        if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.1 201"):
            status = head.split(b"\r\n")[0].decode()
            raise RuntimeError(f"{method} {path}: {status} {body[:200]!r}")
        return body


# What a watcher reads of a page, without decoding it all: the backend encodes every event the one way
# (aibro_backend/recent.encode_event) and puts the page's own fields after the events, so the last match is theirs.
# A full json.loads per answer made the watchers cost more CPU than the backend answering them.
EPOCH_TS = re.compile(rb'"type": "epoch", "ts": ([0-9.e+-]+)')
LAST_SEQ = re.compile(rb'"seq": (\d+)')
PAGE_STATUS = re.compile(rb'"status": "([^"]+)", "substatus": "[^"]*"}$')
PAGE_CURSOR = re.compile(rb'"cursor": (\d+)}$')


def watchers_main() -> None:
    """A process of watchers (`--watchers FILE`): kernels long-polling their job, sidebars their user. Each epoch
    event's (receipt time, latency) and the time of every answer go to FILE.out when the jobs end (or FILE.stop
    appears)."""
    plan = json.loads(Path(sys.argv[2]).read_text())
    seen: list[tuple[float, float]] = []
    answers: list[float] = []
    stop = Path(sys.argv[2] + ".stop")

    async def job_watcher(token: str, job_id: str) -> None:
        conn, after = Conn(plan["events_url"]), 0
        while not stop.exists():
            page = await conn.raw("GET", f"/jobs/{job_id}/events?after={after}&wait=20", token)
            now = time.time()
            answers.append(now)
            seen.extend((now, now - float(ts)) for ts in EPOCH_TS.findall(page))
            seqs = LAST_SEQ.findall(page[-4096:]) or LAST_SEQ.findall(page)
            if seqs:
                after = int(seqs[-1])
            status = PAGE_STATUS.search(page)
            if status is None or status.group(1).decode() in v.JOB_FINAL:
                return

    async def user_watcher(token: str) -> None:
        conn = Conn(plan["events_url"])
        cursor = (await conn.request("GET", "/events?after=0", token))["cursor"]
        while not stop.exists():
            page = await conn.raw("GET", f"/events?after={cursor}&wait=5", token)
            cursor = int(PAGE_CURSOR.search(page).group(1))
            answers.append(time.time())

    async def main() -> None:
        tasks = [
            asyncio.create_task(job_watcher(token, target) if kind == "job" else user_watcher(token))
            for kind, token, target in plan["watchers"]
        ]
        await asyncio.gather(*tasks, return_exceptions=True)

    run_loop(main())
    Path(sys.argv[2] + ".out").write_text(json.dumps({"epochs": seen, "answers": answers}))


def run_loop(main: Any) -> Any:
    """uvloop where installed (the backend's own loop): the watchers' I/O costs less."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def request_floor(
    url: str, token: str, backend_pid: int, path: str = "/health", requests: int = 4000, clients: int = 20
) -> float:
    """The backend's CPU seconds for one request (GET `path` over keep-alive connections, nothing else running):
    /health is the floor of any request on the main port; `/events?after=0` with no events is a long-poll answer
    with nothing to wait for, on either port, which is what bounds the answers one process can give."""

    async def client(n: int) -> None:
        conn = Conn(url)
        for _ in range(n):
            await conn.request("GET", path, token)

    async def main() -> float:
        await client(200)  # warm
        c0 = cpu_s(backend_pid)
        await asyncio.gather(*[client(requests // clients) for _ in range(clients)])
        return (cpu_s(backend_pid) - c0) / requests

    return asyncio.run(main())


def run(args: argparse.Namespace, url: str, tokens: list[str], backend_pid: int, root: Path) -> dict[str, Any]:
    from aibro_jupyter.blobsource import ArraySource
    from aibro_jupyter.client import BackendClient

    # Every user submits `jobs_per_user` jobs, in turns, so the team's first `workers` jobs (2 a user by default)
    # train and the rest queue behind them, as a team's jobs do.
    jobs: list[tuple[str, str]] = []  # (token, job_id)
    clients = [BackendClient(url, token) for token in tokens]
    x = np.zeros((8, 4), "float32")
    shas = []
    for client in clients:
        source = ArraySource(x)
        shas.append(client.upload_source(source, source.sha256())[0])
    say(f"submitting {args.jobs_per_user} jobs for each of {len(tokens)} users")
    for _ in range(args.jobs_per_user):
        for token, client, sha in zip(tokens, clients, shas):
            spec = JobSpec.model_validate(
                {
                    "model": sha,
                    "data": {"x": {"blob": sha}, "y": {"blob": sha}},
                    "fit": {"epochs": 1_000_000, "batch_size": 8},
                    "machines": ["local-cpu"],
                    "cool_down_s": 0.0,
                }
            )
            jobs.append((token, client.submit(spec).job_id))

    # 9 watchers in 10 follow a job (all the team's jobs in turn), 1 in 10 a user; in `procs` processes
    watchers = [
        ("user", tokens[i // 10 % len(tokens)], "") if i % 10 == 9 else ("job", *jobs[i % len(jobs)])
        for i in range(args.watchers)
    ]
    plans = []
    for k in range(args.procs):
        plan = root / f"watchers-{k}.json"
        plan.write_text(json.dumps({"events_url": args.events_url, "watchers": watchers[k :: args.procs]}))
        plans.append(plan)
    nice = ["nice", "-n", str(args.nice)]
    procs = [subprocess.Popen([*nice, sys.executable, str(HERE), "--watchers", str(plan)]) for plan in plans]
    try:
        result = asyncio.run(_drive(args, url, tokens, jobs, backend_pid, [p.pid for p in procs]))
    finally:
        for plan in plans:
            Path(str(plan) + ".stop").touch()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    outs = [json.loads(Path(f"{plan}.out").read_text()) for plan in plans if Path(f"{plan}.out").exists()]
    t0, t1 = result["held"]["window"]
    # epoch events both made and received in the window: a watcher's first pages catch up on events made before it
    # started (old timestamps), which is the log read's cost, not the live latency under the held load
    result["held"]["latency"] = [lat for out in outs for at, lat in out["epochs"] if t0 <= at - lat and at <= t1]
    result["held"]["answers_per_s"] = sum(t0 <= at <= t1 for out in outs for at in out["answers"]) / (t1 - t0)
    return result


async def _drive(
    args: argparse.Namespace,
    url: str,
    tokens: list[str],
    jobs: list[tuple[str, str]],
    backend_pid: int,
    watcher_pids: list[int],
) -> dict[str, Any]:
    """Set the rate, probe /health every 50 ms, and measure the held window, then the flat-out one."""
    health: list[float] = []
    measuring = [False]
    stop = asyncio.Event()

    async def prober() -> None:
        conn = Conn(url)
        while not stop.is_set():
            t0 = time.monotonic()
            await conn.request("GET", "/health", tokens[0])
            if measuring[0]:
                health.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)

    async def events_total() -> int:
        conn, total = Conn(url), 0
        for token in tokens:
            total += sum(j.get("epochs_done", 0) for j in (await conn.request("GET", "/jobs", token))["jobs"])
        conn.writer.close()
        return total * args.batch

    async def snapshot() -> tuple[int, float, tuple[float, float, float], float, float]:
        """Events so far, backend and generator CPU seconds, monotonic and wall time."""
        events = await events_total()
        return events, cpu_s(backend_pid), generator_cpu_s(watcher_pids), time.monotonic(), time.time()

    async def measure(seconds: float) -> dict[str, Any]:
        """Events accepted, CPU and /health round trips over one window."""
        health.clear()
        measuring[0] = True
        e0, c0, g0, t0, w0 = await snapshot()
        await asyncio.sleep(seconds)
        e1, c1, g1, t1, w1 = await snapshot()
        measuring[0] = False
        events = e1 - e0
        return {
            "events_per_s": events / (t1 - t0),
            "cpu_per_1000": 1000 * (c1 - c0) / max(events, 1),
            "cpu_share": (c1 - c0) / (t1 - t0),
            "generator_share": (sum(g1) - sum(g0)) / (t1 - t0),
            "generator_parts": [(b - a) / (t1 - t0) for a, b in zip(g0, g1)],
            "health": list(health),
            "window": (w0, w1),
        }

    args.control.write_text(str(args.rate / args.workers))
    probe = asyncio.create_task(prober())
    say(f"{args.watchers} watchers in {args.procs} processes; warming up {args.warmup} s")
    await asyncio.sleep(args.warmup)
    say(f"held window: {args.rate:.0f} events/s offered for {args.seconds} s")
    spy = profile(backend_pid, args.seconds, args.root / "profile.txt") if args.profile else None
    held = await measure(args.seconds)
    args.control.write_text("0")
    say(f"flat out: workers post as fast as acknowledged for {args.capacity_seconds} s")
    await asyncio.sleep(2)
    flat_out = await measure(args.capacity_seconds)
    say("canceling the jobs")
    conn = Conn(url)
    for token, job_id in jobs:
        await conn.request("POST", f"/jobs/{job_id}/cancel", token)
    stop.set()
    await probe
    return {"held": held, "flat_out": flat_out, "jobs": len(jobs), "spy": spy}


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    if not shutil.which("py-spy"):
        print("(py-spy not installed: no profile)")
        return None
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--nonblocking",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--format",
            "raw",
            "-o",
            str(out),
        ],
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


PARTS = {  # where the backend's time goes, by the frame that does it (a sample counts once per part)
    "worker event posts (parse, check)": "WorkerEventsHandler.post",
    "worker batches' group commits (insert, sync)": "GroupCommit._flush",
    "job long-polls (kernels)": "job_events",
    "user long-polls (sidebars)": "user_events",
    "event port HTTP (parse, answer, write)": "data_received",
    "scheduler ticks": "Scheduler.tick",
    "/health": "HealthHandler.get",
}


def time_by_part(raw: Path) -> list[tuple[str, float]]:
    """Share of the samples under each of PARTS (inclusive), from py-spy's collapsed stacks."""
    counts = dict.fromkeys(PARTS, 0)
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for part, frame in PARTS.items():
            if f";{frame} (" in stack:
                counts[part] += int(count)
    return [(part, c / max(total, 1)) for part, c in counts.items()]


def main() -> None:
    if "--sim-worker" in sys.argv:
        sim_worker()
        return
    if sys.argv[1:2] == ["--watchers"]:
        watchers_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 watchers, 10 workers, 10 s windows")
    parser.add_argument("--rate", type=float, default=5000, help="events/s the workers offer in the held window")
    parser.add_argument("--profile", action="store_true", help="py-spy the backend during the held window")
    parser.add_argument("--keep", action="store_true", help="keep the temporary AIBRO_HOME")
    parser.add_argument("--same-priority", action="store_true", help="run the load generator at the backend's priority")
    parser.add_argument("--main-port", action="store_true", help="watchers long-poll the main port, not the event port")
    args = parser.parse_args()
    args.nice = 0 if args.same_priority else GENERATOR_NICE
    args.users = 10
    args.workers = 10 if args.quick else 20
    args.jobs_per_user = 5  # the default policy's limit of active (training + queued) jobs per user
    args.watchers = 200 if args.quick else 1000
    args.seconds = 10 if args.quick else 30
    args.capacity_seconds = 10
    args.warmup = 5 if args.quick else 10
    args.procs = 2  # watcher processes
    args.batch = 50
    root = args.root = Path(tempfile.mkdtemp(prefix="aibro-bench-load-"))
    args.control = root / "rate"  # events/s per worker, read by the simulated workers
    args.control.write_text(str(args.rate / args.workers))  # the held rate from the first batch on
    os.environ["BENCH_BATCH"] = str(args.batch)
    os.environ["BENCH_CONTROL"] = str(args.control)
    home = root / "home"
    home.mkdir()
    proc, url, _ = start_backend(home, args.workers, args.nice)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` or a runner stopping us still cleans up
    spy = None
    try:
        tokens = [add_user(home, f"user{i}") for i in range(args.users)]
        floor = request_floor(url, tokens[0], proc.pid)
        poll_main = request_floor(url, tokens[0], proc.pid, "/events?after=0")
        port = asyncio.run(Conn(url).request("GET", "/health", tokens[0])).get("events_port")
        fast = f"{url.rsplit(':', 1)[0]}:{port}" if port else url
        poll_fast = request_floor(fast, tokens[0], proc.pid, "/events?after=0") if port else float("nan")
        args.events_url = url if args.main_port else fast
        say(f"watchers long-poll {'the main port' if args.events_url == url else f'the event port {port}'}")
        r = run(args, url, tokens, proc.pid, root)
        spy = r.pop("spy", None)
        if spy is not None:
            spy.wait(timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["pkill", "-f", f"{HERE} --sim-worker"], check=False)
    held, flat = r["held"], r["flat_out"]
    lat, hl, fhl = held["latency"], held["health"], flat["health"]
    per_job = (args.watchers - args.watchers // 10) / r["jobs"]
    rows = [
        ("users / jobs (training + queued)", f"{args.users} / {r['jobs']}", ""),
        ("simulated workers (training jobs)", f"{args.workers}", ""),
        ("watchers: long-polls held", f"{args.watchers}", "1000"),
        ("  on a job each / on a user each", f"{per_job:.0f} / {args.watchers // 10 / args.users:.0f}", ""),
        ("held window: events offered / s", f"{args.rate:.0f}", ""),
        ("  events accepted / s (durable)", f"{held['events_per_s']:.0f}", ">= 5000"),
        ("  epoch event -> watcher p50 / p95 ms", f"{ms(pct(lat, 0.5))} / {ms(pct(lat, 0.95))}", "p95 <= 100"),
        (
            "  /health p50 / p95 / max ms",
            f"{ms(pct(hl, 0.5))} / {ms(pct(hl, 0.95))} / {ms(max(hl or [0]))}",
            "p95 <= 50",
        ),
        ("  backend CPU s per 1,000 events", f"{held['cpu_per_1000']:.3f}", ""),
        ("  long-poll answers / s (to all watchers)", f"{held['answers_per_s']:.0f}", ""),
        ("  backend busy (CPU s per s)", f"{held['cpu_share']:.2f}", ""),
        (f"  load generator CPU s per s (nice {args.nice})", f"{held['generator_share']:.2f}", ""),
        ("    watchers / workers / harness", " / ".join(f"{x:.2f}" for x in held["generator_parts"]), ""),
        ("flat out: events accepted / s", f"{flat['events_per_s']:.0f}", "(capacity)"),
        ("  /health p50 / p95 ms", f"{ms(pct(fhl, 0.5))} / {ms(pct(fhl, 0.95))}", ""),
        ("  backend CPU s per 1,000 events", f"{flat['cpu_per_1000']:.3f}", ""),
        ("backend CPU us per plain request (GET /health)", f"{1e6 * floor:.0f}", ""),
        ("  so one process answers at most / s", f"{1 / floor:.0f}", ""),
        ("backend CPU us per long-poll answer: main port", f"{1e6 * poll_main:.0f}", ""),
        (
            "  event port (watchers used: " + ("main)" if args.main_port else "event port)"),
            f"{1e6 * poll_fast:.0f}",
            "",
        ),
        ("  main / event port", f"{poll_main / poll_fast:.1f}x", ""),
        ("worker batches per commit (whole run)", batches_per_commit(root / "backend.log"), ""),
        ("cores on this machine", f"{os.cpu_count()}", ""),
    ]
    width = max(len(a) for a, _, _ in rows)
    print(f"\n{'load':<{width}}  {'measured':>18}  target")
    for name, got, target in rows:
        print(f"{name:<{width}}  {got:>18}  {target}")
    if args.profile and (root / "profile.txt").exists():
        print("\nbackend time in the held window by part (py-spy; the rest is tornado's HTTP handling and I/O):")
        for name, share in time_by_part(root / "profile.txt"):
            print(f"  {100 * share:5.1f}%  {name}")
        print("\nbackend self time in the held window (py-spy):")
        for name, share in top_functions(root / "profile.txt"):
            print(f"  {100 * share:5.1f}%  {name}")
    mean = statistics.mean(lat) * 1000 if lat else float("nan")
    print(f"\n{mean:.0f} ms mean latency over {len(lat)} epoch events in the held window")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def batches_per_commit(log: Path) -> str:
    """The group commit's size, from the line the backend logs when it stops (groupcommit.GroupCommit.summary)."""
    found = re.findall(r"worker event batches: \d+ in \d+ commits \(([\d.]+) per commit\)", log.read_text())
    return found[-1] if found else "-"


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}"


if __name__ == "__main__":
    main()
