"""A soak: several users train on one backend for a set time while a seeded fault injector kills and freezes its
parts; at the end, checks that nothing was lost and nothing was left behind (issue 39 items 1-2).

Each fault alone has its own test; teams meet them together, under load. Here a real backend process on 127.0.0.1
(the local provider, real sandboxed workers, real TensorFlow) serves N users (default 4). Each user is a loop that
runs kernel-side clients as subprocesses, one at a time, as a notebook would: a fit followed to its end and
collected (`Training.submit/watch/collect`), a detached job (submitted, not followed), and now and then a small
KerasTuner study (`search.start_study`, `follow`, `finish`: the `%%cloud_tune` path).

The injector draws its schedule from the seed before the run starts (same seed, same schedule: times and kinds;
which worker or client a fault hits is whichever is there at that moment) and logs every fault and what it hit:

* ``kill_worker``: SIGKILL the worker process of a training instance (the job resumes from its checkpoint);
* ``kill_backend``: SIGKILL the backend and start it again, at once or after a pause (it comes back on its port);
* ``kill_client``: SIGKILL the next kernel-side client once it has uploaded its first blob (mid-upload);
* ``stop_worker``: SIGSTOP a training worker for a while, then SIGCONT it;
* ``fill_disk``: a user's job fills its folder past the job disk limit (it must end naming the limit);
* ``kill_oracle``: SIGKILL a running study's oracle host (the backend starts it again; the study goes on).

A user whose kernel was killed runs the same cell again (the same data), as a user would.

`--provider aws` runs the same users on moto-backed AWS (benchmarks/soak_aws.py): the AWS provider against moto's
server, the tests' played EC2 instances running the real agent, every S3 request (the backend's, and the presigned
ones of kernels and workers) through a fault-injecting proxy (tests/flaky_s3.py), each job on a spot machine of 5.6
MB of data (a multipart upload). Its faults:

* ``s3``: for 10 to 40 s, 30 to 100 % of the S3 requests meet a 500, a 503, a 503 SlowDown, a dropped connection
  (before, during or after the request's body, or its answer lost) or an 8 s delay;
* ``spot``: AWS's two-minute notice on a training machine's metadata service, and its termination 15 s later;
* ``kill_backend``, ``kill_client`` and ``kill_oracle`` as above.

kill_worker and stop_worker stay the local provider's: a played machine has no systemd to bring a killed agent
back, and the backend has no heartbeat for a cloud worker (a frozen machine holds its job until
max_instance_hours). The local provider has no heartbeat either (a worker is alive while its pid is), so a stopped
worker is not declared lost: the check is that it carries on after SIGCONT. Not checked yet: ports (a worker's
port needs its process, which is checked).

Found so far: a study's follower (`search.follow`, behind `%%cloud_tune` and `Training.online_search`) raised
BackendUnreachable at its first poll while a configured backend was down (tests/test_study_follow_restart.py). A
`collect` (model download) finding a configured backend down raises (the client's documented behaviour: only
`follow` retries); it is counted in the report. A study's oracle host killed while it started failed the study
("the oracle host did not start"), and one killed while KerasTuner rewrote its oracle.json or a trial.json in place
left a file no later start could reload (tests/test_study_oracle_restart.py, test_compat.test_utils_save_json). On
AWS: ten seconds of S3 500s on a third of the requests failed a job (its checkpoint's finish ran out of the
backend's S3 retries, 507, and the worker gave up the file); a kernel's upload failed after four refusals of one
part in 3.5 s; the backend aborted a multipart upload whose completion S3 had answered 503; uploads never finished
(a client killed, one given up), a publish cut short and a failed job's unindexed checkpoint left keys and
multipart uploads in the bucket for good; a download S3 dropped after the backend's redirect was taken for the
backend being out of reach and not tried again (tests/test_s3_faults.py holds each).

At the end it waits (on states, bounded) for every job, study and instance to end, then checks and prints:
every job COMPLETED or CANCELED with a reason a user can read; every epoch of every job exactly once, in order, in
its History and its event log; every COMPLETED job's model.keras loads and equals its last checkpoint; each study
trial ran once with a score or a reason; no worker process, instance folder or unfinished upload left over for an
ended job (on AWS: no agent of a closed instance, and no S3 key or multipart upload that nothing accounts for:
what the backend holds, what its index holds, or what is due to go once the URLs handed out for it expire); the
backend's RSS and open files flat between the first and last fifth of the run; no WARNING/ERROR line in
the backend log that the faults do not explain. Exit status 0 when every check passes.

    python benchmarks/soak.py --minutes 30 --users 4 --seed 1
    python benchmarks/soak.py --provider aws --minutes 30 --users 2 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from aibro_core.vocabulary import (  # noqa: E402
    JOB_FINAL,
    STUDY_FINAL,
    InstanceStatus,
    JobStatus,
    TrialStatus,
)

from helpers import find_worker_process, pids_where  # noqa: E402 - tests/ is no package

KINDS = ("kill_worker", "kill_backend", "kill_client", "stop_worker", "fill_disk", "kill_oracle")
# On moto-backed AWS (--provider aws): the S3 endpoint misbehaving for a while, AWS's spot notice, and the faults of
# the backend and the kernel that do not depend on where the worker runs. A played machine has no systemd to bring a
# killed agent back and the backend no heartbeat for a cloud worker (a frozen machine holds its job until
# max_instance_hours): kill_worker and stop_worker are the local provider's.
AWS_KINDS = ("kill_backend", "kill_client", "s3", "spot", "kill_oracle")
S3_FAULTS = ("500", "503", "slowdown", "drop", "slow")
ROWS_AWS = 22_000  # 5.6 MB of data: over S3's smallest part (5 MiB), so it goes as a multipart upload
DISK_LIMIT = 8 << 20

# WARNING/ERROR lines of the backend log that the injected faults explain; any other such line fails the run. None
# of the local faults should write one (a lost worker, a full disk, a restart are events of the job, not warnings:
# none in three runs, 3 to 12 minutes); the S3 faults will add theirs here.
EXPECTED_LOG: tuple[str, ...] = (r"oracle_client WARNING oracle host of \S+ ended \(exit -9\); starting it again",)
# What an S3 endpoint failing for a while explains on AWS: the backend's S3 calls that failed past botocore's
# retries, answered 503 (the client tries again), and the bucket upkeep that tries again at its next round.
EXPECTED_LOG_AWS = (
    r"aibro\.backend WARNING S3 call \w+ failed",
    r"tornado\.access ERROR 503 (POST|GET|HEAD) /api/v1/",
    r"claims WARNING could not (publish user \d+'s upload|delete \S+ from the bucket) .*yet",
)


@dataclass
class Config:
    users: int = 4
    minutes: float = 30.0
    seed: int = 1
    epochs: int = 4
    rows: int = 3000
    slots: int = 2
    mean_gap_s: float = 45.0  # mean time between faults (exponential gaps)
    stop_s: float = 20.0  # how long a stopped worker stays stopped
    study: bool = True
    schedule: list[tuple[float, str]] | None = None  # fixed (seconds from start, kind): the short test's
    drain_s: float = 900.0  # bound on waiting for everything to end after the submissions stop
    root: Path | None = None  # where the home, logs and reports go (default: a fresh temporary folder)
    provider: str = "local"  # or "aws": moto-backed, with its S3 through a fault-injecting proxy

    @property
    def kinds(self) -> tuple[str, ...]:
        return AWS_KINDS if self.provider == "aws" else KINDS

    @property
    def machine(self) -> str:
        from soak_aws import SPOT

        return SPOT if self.provider == "aws" else "local-cpu"


@dataclass
class Record:
    """What the run saw: the jobs and studies each user made, the faults, the backend's samples."""

    jobs: dict[str, tuple[str, str]] = field(default_factory=dict)  # job id -> (user, kind)
    studies: dict[str, str] = field(default_factory=dict)  # study id -> user
    faults: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, pid, rss KiB, open fds)
    clients: list[tuple[str, str, int]] = field(default_factory=list)  # (user, kind, rc)
    lost_followers: list[str] = field(default_factory=list)  # study followers a backend restart ended
    unreachable: list[str] = field(default_factory=list)  # clients that found the backend down (submit, collect)
    not_again: int = 0  # killed clients whose cell was not run again (the submissions had stopped)
    lock: threading.Lock = field(default_factory=threading.Lock)


def schedule(cfg: Config) -> list[tuple[float, str]]:
    """The faults' times and kinds, from the seed alone."""
    if cfg.schedule is not None:
        return list(cfg.schedule)
    rng = random.Random(cfg.seed)
    out, t, end = [], 0.0, cfg.minutes * 60
    while True:
        t += rng.expovariate(1 / cfg.mean_gap_s)
        if t >= end:
            return out
        out.append((round(t, 1), rng.choice(cfg.kinds)))


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: val for k, val in os.environ.items() if k not in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    return {**env, "AIBRO_HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1", **extra}


class Backend:
    """The backend process: started, SIGKILLed and started again on the same home (it takes its last port back)."""

    def __init__(self, home: Path, slots: int) -> None:
        self.home, self.log = home, home.with_name("backend.log")
        self.args: list[str] = []  # what else `serve` is told (the AWS provider)
        self.env = _env(
            home,
            AIBRO_LOCAL_CAPACITY=str(slots),
            AIBRO_JOB_MAX_DISK_BYTES=str(DISK_LIMIT),
            AIBRO_MAX_ACTIVE_JOBS="6",
        )
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.token = ""

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aibro_backend", "--home", str(self.home), "--port", "0", *self.args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the backend did not start: {self.log.read_text()[-2000:]}")
            try:
                info = json.loads((self.home / "backend.json").read_text())
                self.token = json.loads((self.home / "credentials.json").read_text())["token"]
                if info.get("pid") == self.proc.pid:
                    self.url = info["url"]
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def db(self, sql: str, *params: Any) -> list[tuple]:
        """Rows of the backend's own database: what the API never shows (pids)."""
        db = sqlite3.connect(str(self.home / "state" / "aibro.db"), timeout=30)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()


def workers_under(home: Path) -> dict[int, str]:
    """Every process whose AIBRO_WORKER_DIR lies under `home`, with that folder."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"AIBRO_WORKER_DIR=") and item[17:].decode(errors="replace").startswith(str(home)):
                    found[int(proc.name)] = item[17:].decode(errors="replace")
    return found


class Soak:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.root = cfg.root or Path(tempfile.mkdtemp(prefix="aibro-soak-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.backend = Backend(self.root / "home", cfg.slots)
        self.rec = Record()
        self.tokens: dict[str, str] = {}
        self.t0 = 0.0
        self.deadline = 0.0
        self.done = threading.Event()  # the submissions stop
        self.kill_next_upload = threading.Event()
        self.backend_up = threading.Event()
        self.running: dict[str, subprocess.Popen] = {}  # user -> its client now
        self.extra: list[threading.Thread] = []  # the injector's own clients (fill_disk)
        self.aws: Any = None  # soak_aws.AwsWorld with --provider aws

    # -- logging ----------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.t0:7.1f}s] {line}"
        print(stamp, flush=True)
        if line.startswith("fault "):
            with self.rec.lock:
                self.rec.faults.append(line.split(":")[0][6:])
        with open(self.root / "soak.log", "a") as f:
            f.write(stamp + "\n")

    # -- users ------------------------------------------------------------------------------------
    def client(self, user: str, kind: str, seed: int, again: int = 0) -> int:
        """One kernel-side client as a subprocess; its JOB/STUDY lines are recorded; killed mid-upload when the
        injector asked for it. `again`: how many times the user ran this same cell before."""
        argv = [sys.executable, str(HERE / "soak.py"), "client", "--kind", kind, "--seed", str(seed)]
        argv += ["--epochs", str(self.cfg.epochs), "--rows", str(self.cfg.rows), "--machine", self.cfg.machine]
        tmp = self.root / "clients" / (f"{user}-{seed}" + (f"-again{again}" if again else ""))
        tmp.mkdir(parents=True)
        env = _env(
            self.root / "users" / user,
            AIBRO_BACKEND_URL=self.backend.url,
            AIBRO_TOKEN=self.tokens[user],
            TMPDIR=str(tmp),
            PYTHONUNBUFFERED="1",
        )
        with open(tmp.with_suffix(".log"), "w") as out:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=out, text=True, cwd=tmp)
            self.running[user] = proc
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                word, _, rest = line.strip().partition(" ")
                with self.rec.lock:
                    if word == "JOB":
                        self.rec.jobs[rest] = (user, kind)
                    elif word == "STUDY":
                        self.rec.studies[rest] = user
                    elif word == "FOLLOW-LOST":
                        self.rec.lost_followers.append(f"{user}: {rest}")
                    elif word == "UNREACHABLE":
                        self.rec.unreachable.append(f"{user}/{kind}: {rest}")
                if word == "UPLOADED" and self.kill_next_upload.is_set():
                    self.kill_next_upload.clear()
                    proc.kill()
                    self.log(f"fault kill_client: SIGKILLed {user}'s {kind} client (pid {proc.pid}) mid-upload")
            rc = proc.wait()
            self.running.pop(user, None)
        with self.rec.lock:
            self.rec.clients.append((user, kind, rc))
        return rc

    def active(self, user: str) -> int:
        """Jobs of `user` not yet ended, from the backend's own table (the injector may have it down: then 0 new)."""
        with self.rec.lock:
            mine = [j for j, (u, _) in self.rec.jobs.items() if u == user]
        if not mine:
            return 0
        marks = ",".join("?" * len(mine))
        try:
            rows = self.backend.db(f"SELECT status FROM jobs WHERE id IN ({marks})", *mine)
        except sqlite3.Error:
            return len(mine)
        return sum(1 for (st,) in rows if st not in JOB_FINAL)

    def user_loop(self, user: str, n: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + n)
        k = 0
        while not self.done.is_set():
            if self.active(user) >= 2:  # a user keeps at most two jobs going, as one notebook would
                self.done.wait(1)
                continue
            kind = rng.choice(["fit", "fit", "fit", "detached", "detached"] + (["study"] if self.cfg.study else []))
            k += 1
            again = 0
            while self.client(user, kind, n * 1000 + k, again) == -signal.SIGKILL:
                if self.done.is_set():
                    with self.rec.lock:
                        self.rec.not_again += 1
                    break
                again += 1  # its kernel was killed mid-upload: the user runs the same cell again, same data

    # -- faults -----------------------------------------------------------------------------------
    def training_workers(self) -> list[tuple[str, int]]:
        """(instance id, worker python pid) of every instance now running a TRAINING job (on AWS: the agent of its
        played machine)."""
        rows = self.backend.db(
            "SELECT i.id, i.pid FROM instances i JOIN jobs j ON j.instance_id = i.id "
            "WHERE j.status = ? AND i.status = ? ORDER BY i.id",
            JobStatus.TRAINING,
            InstanceStatus.EXECUTING,
        )
        out = []
        for iid, pid in rows:
            wp = self.aws.agent(iid) if self.aws is not None else find_worker_process(int(pid)) if pid else None
            if wp:
                out.append((iid, wp))
        return out

    def oracle_hosts(self, within_s: float) -> list[int]:
        """The pids of the running studies' oracle hosts, waiting for one to be there (bounded)."""
        end = time.monotonic() + within_s
        studies = str(self.backend.home / "state" / "studies").encode()

        def host(argv: list[bytes]) -> bool:
            return b"aibro_backend.tuning.oracle_host" in argv and any(a.startswith(studies) for a in argv)

        while time.monotonic() < end and not self.done.is_set():
            found = pids_where(host)
            if found:
                return found
            time.sleep(0.5)
        return []

    def pick_worker(self, rng: random.Random, within_s: float = 120) -> tuple[str, int] | None:
        """A training worker, waiting for one to be there (bounded)."""
        end = time.monotonic() + within_s
        while time.monotonic() < end and not self.done.is_set():
            found = self.training_workers()
            if found:
                return rng.choice(found)
            time.sleep(0.5)
        return None

    def inject(self, kind: str, rng: random.Random, n: int) -> None:
        if kind == "kill_worker":
            hit = self.pick_worker(rng)
            if hit:
                os.kill(hit[1], signal.SIGKILL)
            self.log(f"fault kill_worker: {'SIGKILLed the worker of ' + hit[0] if hit else 'no training worker'}")
        elif kind == "stop_worker":
            hit = self.pick_worker(rng)
            if not hit:
                self.log("fault stop_worker: no training worker")
                return
            os.kill(hit[1], signal.SIGSTOP)
            self.log(f"fault stop_worker: SIGSTOPped the worker of {hit[0]} for {self.cfg.stop_s:.0f} s")
            time.sleep(self.cfg.stop_s)  # the fault's length, not a correctness wait
            try:
                os.kill(hit[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.log(f"fault stop_worker: SIGCONTed the worker of {hit[0]}")
        elif kind == "kill_backend":
            pause = rng.choice([0.0, 0.0, 5.0, 15.0])
            self.backend_up.clear()
            self.backend.kill()
            self.log(f"fault kill_backend: SIGKILLed the backend, restarting after {pause:.0f} s")
            time.sleep(pause)  # the outage's length
            try:
                self.backend.start()
            except RuntimeError as exc:  # a finding: say so, and try once more so the run can end and check
                self.log(f"fault kill_backend: FINDING: the backend did not start again: {exc}")
                self.backend.start()
            self.backend_up.set()
            self.log(f"fault kill_backend: backend back at {self.backend.url} (pid {self.backend.pid})")
        elif kind == "kill_client":
            self.kill_next_upload.set()
            self.log("fault kill_client: the next client to upload a blob is SIGKILLed")
        elif kind == "kill_oracle":
            hosts = self.oracle_hosts(within_s=120)
            for pid in hosts:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.log(f"fault kill_oracle: {f'SIGKILLed oracle host(s) {hosts}' if hosts else 'no study running'}")
        elif kind == "s3":
            what, seconds = rng.choice(S3_FAULTS), rng.choice([10.0, 20.0, 40.0])
            share = rng.choice([0.3, 0.6, 1.0])
            self.aws.s3_fault(what, seconds, share)
            self.log(f"fault s3: the S3 endpoint answers {what} to {share:.0%} of its requests for {seconds:.0f} s")
        elif kind == "spot":
            hit = self.pick_worker(rng)
            self.log(f"fault spot: {self.aws.spot_notice(hit[0]) if hit else 'no training machine'}")
        elif kind == "fill_disk":
            user = f"user{rng.randrange(self.cfg.users)}"
            self.log(f"fault fill_disk: {user} submits a job that fills its folder past {DISK_LIMIT >> 20} MiB")
            extra = threading.Thread(target=self.client, args=(user, "disk", 900_000 + n))
            self.extra.append(extra)
            extra.start()

    def injector(self) -> None:
        rng = random.Random(self.cfg.seed + 7)
        for n, (at, kind) in enumerate(schedule(self.cfg)):
            while time.monotonic() - self.t0 < at:
                if self.done.wait(min(1.0, at - (time.monotonic() - self.t0))):
                    return
            self.inject(kind, rng, n)

    def monitor(self) -> None:
        """The backend's RSS and open descriptors every 5 s."""
        while not self.done.wait(5):
            pid = self.backend.pid
            try:
                rss = next(
                    int(line.split()[1])
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            with self.rec.lock:
                self.rec.samples.append((time.monotonic() - self.t0, pid, rss, fds))

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> Report:
        sys.path.insert(0, str(HERE.parent / "backend"))
        self.t0 = time.monotonic()
        self.log(
            f"soak: {self.cfg.users} users, {self.cfg.minutes} min, seed {self.cfg.seed}, provider {self.cfg.provider}"
            f", root {self.root}"
        )
        for at, kind in schedule(self.cfg):
            self.log(f"  scheduled {kind} at {at:.1f} s")
        if self.cfg.provider == "aws":
            from soak_aws import AwsWorld

            self.aws = AwsWorld(self.root, self.cfg.seed, self.log)
            self.backend.args = self.aws.backend_args()
            self.backend.env.update(self.aws.backend_env())
        try:
            return self._run()
        finally:
            if self.aws is not None:
                self.aws.close()

    def _run(self) -> Report:
        from aibro_backend.server.accounts import add_user

        self.backend.start()
        if self.aws is not None:
            self.aws.start_machines(self.backend.url)
        self.backend_up.set()
        for n in range(self.cfg.users):
            self.tokens[f"user{n}"] = add_user(self.backend.home, f"user{n}")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.cfg.minutes * 60
        threads = [threading.Thread(target=self.user_loop, args=(f"user{n}", n)) for n in range(self.cfg.users)]
        threads += [threading.Thread(target=self.injector), threading.Thread(target=self.monitor, daemon=True)]
        for t in threads:
            t.start()
        while time.monotonic() < self.deadline:
            time.sleep(1)
        self.done.set()
        self.log("soak: submissions stop; waiting for every client, job, study and instance to end")
        bound = time.monotonic() + self.cfg.drain_s
        for t in threads[:-1]:
            t.join(max(1.0, bound - time.monotonic()))
        for t in self.extra:  # the injector's own clients, all started now that the injector is done
            t.join(max(1.0, bound - time.monotonic()))
        try:
            return check(self, bound)
        finally:
            self.backend.stop()
            for pid in workers_under(self.backend.home):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


# -- checks ---------------------------------------------------------------------------------------
@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def ok(self, what: str, good: bool, detail: str = "") -> None:
        self.lines.append(f"{'PASS' if good else 'FAIL'}  {what}{': ' + detail if detail else ''}")
        if not good:
            self.failures.append(what)

    def text(self) -> str:
        return "\n".join(self.lines)


def _until(cond: Callable[[], Any], bound: float) -> Any:
    """`cond()`'s first true value, or None at the bound (which only stops a hang)."""
    while not (found := cond()):
        if time.monotonic() > bound:
            return None
        time.sleep(1)
    return found


def check(soak: Soak, bound: float) -> Report:
    from aibro_jupyter.client import BackendClient

    rep = Report()
    be = soak.backend
    clients = {u: BackendClient(be.url, t) for u, t in soak.tokens.items()}
    jobs = dict(soak.rec.jobs)
    studies = dict(soak.rec.studies)

    def trial_jobs() -> None:
        for sid, user in studies.items():
            for t in clients[user].study(sid).trials:
                jobs.setdefault(t.job_id, (user, "trial"))

    def studies_ended() -> bool:
        return all(clients[u].study(s).status in STUDY_FINAL for s, u in studies.items())

    def jobs_ended() -> bool:
        trial_jobs()
        return all(clients[u].job(j).status in JOB_FINAL for j, (u, _) in jobs.items())

    ended = _until(lambda: studies_ended() and jobs_ended(), bound)
    rep.ok("every job and study ended", bool(ended), f"{len(jobs)} jobs, {len(studies)} studies")
    closed = _until(lambda: not be.db("SELECT id FROM instances WHERE status NOT IN ('CLOSED')"), bound)
    rep.ok("every instance closed", bool(closed))

    # Each job: its end, its reason, its epochs.
    views = {j: clients[u].job(j) for j, (u, _) in jobs.items()}
    by_status: dict[str, int] = {}
    unreadable, epoch_bad = [], []
    for j, job in views.items():
        by_status[str(job.status)] = by_status.get(str(job.status), 0) + 1
        if job.status != JobStatus.COMPLETED and (not job.error or job.error.lstrip().startswith("Traceback")):
            unreadable.append(f"{j} {job.status} {job.error!r}")
        hist = [r.epoch for r in job.history]
        want = list(range(1, job.epochs + 1)) if job.status == JobStatus.COMPLETED else list(range(1, len(hist) + 1))
        evs: list[int] = []
        after = 0
        while True:
            page = clients[jobs[j][0]].events(j, after)
            evs += [e["data"]["epoch"] + 1 for e in page["events"] if e["type"] == "epoch"]
            if not page["events"]:
                break
            after = page["events"][-1]["seq"]
        if hist != want or evs != want:
            epoch_bad.append(f"{j} ({job.status}) history {hist} events {evs}, want {want}")
    kinds: dict[str, int] = {}
    for _, kind in jobs.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    rep.ok("jobs", True, f"{by_status} by kind {kinds}")
    rep.ok("every failed/canceled job has a readable reason", not unreadable, "; ".join(unreadable[:5]))
    rep.ok("every epoch exactly once, in order (History and events)", not epoch_bad, "; ".join(epoch_bad[:5]))
    disk = [views[j] for j, (_, k) in jobs.items() if k == "disk"]
    rep.ok(
        "every disk-filling job ended naming the limit",
        all(d.status == JobStatus.CANCELED and "AIBRO_JOB_MAX_DISK_BYTES" in (d.error or "") for d in disk),
        f"{len(disk)} jobs",
    )
    rcs: dict[int, int] = {}
    for _, _, rc in soak.rec.clients:
        rcs[rc] = rcs.get(rc, 0) + 1
    failed = [f"{u}/{k}" for u, k, rc in soak.rec.clients if rc not in (0, 3, -signal.SIGKILL)]
    rep.ok(
        "every client not killed ended 0, or found the backend down and said so (3)",
        not failed,
        f"exit codes {rcs}; failed: {failed[:8]} (logs: clients/)",
    )
    down = soak.rec.unreachable
    submit = sum(1 for d in down if "submit" in d)
    rep.ok("clients that found the backend down (info)", True, f"{submit} at submit, {len(down) - submit} at collect")
    lost = soak.rec.lost_followers
    rep.ok("no study follower gave up on an outage (followed again if one did)", not lost, "; ".join(lost[:5]))

    # Each COMPLETED job's model equals its last checkpoint.
    import keras
    import numpy as np

    unequal = []
    done = [j for j, job in views.items() if job.status == JobStatus.COMPLETED]
    with tempfile.TemporaryDirectory(prefix="soak-models-") as d:
        for j in done:
            c = clients[jobs[j][0]]
            names = sorted(a.name for a in c.artifacts(j) if a.name.startswith("checkpoints/"))
            if not names:
                unequal.append(f"{j}: no checkpoint")
                continue
            try:
                got = keras.saving.load_model(c.download_artifact(j, "model.keras", Path(d) / f"{j}.keras"))
                last = keras.saving.load_model(c.download_artifact(j, names[-1], Path(d) / f"{j}-ckpt.keras"))
            except Exception as exc:  # noqa: BLE001 - the report names it
                unequal.append(f"{j}: {exc}")
                continue
            if len(got.weights) != len(last.weights) or not all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got.weights, last.weights, strict=True)
            ):
                unequal.append(f"{j}: model.keras differs from {names[-1]}")
    rep.ok("every COMPLETED job's model loads and equals its last checkpoint", not unequal, "; ".join(unequal[:5]))

    # Studies: each trial once, with a score or a reason.
    bad_trials = []
    for sid, user in studies.items():
        st = clients[user].study(sid)
        ids = [t.trial_id for t in st.trials]
        if len(ids) != len(set(ids)) or len({t.job_id for t in st.trials}) != len(ids):
            bad_trials.append(f"{sid}: a trial or its job twice")
        for t in st.trials:
            if t.score is None and not t.message:
                bad_trials.append(f"{sid}/{t.trial_id} {t.status}: no score, no reason")
            if len(t.executions) != st.executions_per_trial and t.status == TrialStatus.COMPLETED:
                bad_trials.append(f"{sid}/{t.trial_id}: {len(t.executions)} executions")
    rep.ok("every study trial ran once with a score or a reason", not bad_trials, "; ".join(bad_trials[:5]))

    # Leftovers of ended jobs.
    closed_ids = {i for (i,) in be.db("SELECT id FROM instances WHERE status = 'CLOSED'")}
    if soak.aws is not None:  # a closed instance's machine is gone (terminated), its agent with it
        procs = {i: soak.aws.agent(i) for i in closed_ids if soak.aws.agent(i)}
        rep.ok("no agent of a closed instance", not procs, str(procs)[:300])
        ended = {j for j, job in views.items() if job.status in JOB_FINAL}
        left: dict[str, list[str]] = {}

        def clean() -> bool:  # the backend's upkeep may still be at work: waited for, within the bound
            left.update(soak.aws.leftovers(be.home / "state" / "aibro.db", ended))
            return not any(left.values())

        clean_now = bool(_until(clean, time.monotonic() + 60))
        detail = "; ".join(f"{k}: {v[:3]} ({len(v)})" for k, v in left.items() if v)
        rep.ok("no S3 key or multipart upload left over that belongs to an ended job", clean_now, detail)
        rep.ok("S3 requests (info)", True, soak.aws.counts())
    else:
        procs = {pid: d for pid, d in workers_under(be.home).items() if Path(d).name in closed_ids}
        rep.ok("no worker process of a closed instance", not procs, str(procs)[:300])
        wdir = be.home / "state" / "workers"
        folders = sorted(p.name for p in wdir.iterdir() if p.name in closed_ids) if wdir.exists() else []
        rep.ok("no folder of a closed instance", not folders, str(folders[:5]))
    partial = be.home / "state" / "blobs" / "partial"
    parts = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file()) if partial.exists() else []
    killed = sum(1 for _, _, rc in soak.rec.clients if rc == -signal.SIGKILL)
    rep.ok(
        "no unfinished upload left (a killed client's cell was run again: it resumes or finds the blob there)",
        not parts or soak.rec.not_again > 0,
        f"{len(parts)} partial files {parts[:3]}, {killed} clients killed, {soak.rec.not_again} not run again",
    )
    state = be.home / "state"
    tmps = [str(p.relative_to(state)) for p in state.rglob("*.tmp") if "workers" not in p.relative_to(state).parts]
    rep.ok("no half-written file (*.tmp) in the backend's state", not tmps, str(tmps[:5]))
    left = [p for p in (soak.root / "clients").glob("*/*") if p.name != "tuner"]
    rep.ok("clients' temporary files (info)", True, f"{len(left)} left (a killed client cannot clean its own)")

    # The backend's memory and descriptors, first fifth against last fifth (of the samples of the run).
    s = soak.rec.samples
    if len(s) >= 10:
        k = max(2, len(s) // 5)
        rss0, rss1 = statistics.median(x[2] for x in s[:k]), statistics.median(x[2] for x in s[-k:])
        fd0, fd1 = statistics.median(x[3] for x in s[:k]), statistics.median(x[3] for x in s[-k:])
        rep.ok(
            "backend RSS flat (last fifth within 25% + 20 MiB of the first)",
            rss1 <= rss0 * 1.25 + 20 * 1024,
            f"{rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB",
        )
        rep.ok("backend open files flat (within 10)", fd1 <= fd0 + 10, f"{fd0:.0f} -> {fd1:.0f}")
    else:
        rep.ok("backend RSS and open files", True, f"only {len(s)} samples: not judged")

    # The backend log.
    text = be.log.read_text(errors="replace") if be.log.exists() else ""
    loud = [ln for ln in text.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", ln)]
    expected = EXPECTED_LOG + (EXPECTED_LOG_AWS if soak.aws is not None else ())
    unexpected = [ln for ln in loud if not any(re.search(p, ln, re.I) for p in expected)]
    rep.ok(
        "no unexpected line in the backend log",
        not unexpected,
        f"{len(loud)} warning/error lines, {len(unexpected)} unexpected"
        + ("\n    " if unexpected else "")
        + "\n    ".join(unexpected[:15]),
    )
    hits: dict[str, int] = {}
    for f in soak.rec.faults:
        hits[f] = hits.get(f, 0) + 1
    rep.lines.insert(0, f"fault lines logged (a stop_worker, kill_backend, kill_client or spot logs two): {hits}")
    return rep


# -- the kernel-side client -------------------------------------------------------------------------
def client_main(kind: str, seed: int, epochs: int, rows: int, machine: str = "local-cpu") -> int:
    """A notebook's kernel, as a process of its own: builds, uploads (saying after each blob), submits."""
    sys.path.insert(0, str(HERE))
    import soak_layers as sl

    from aibro_core.errors import BackendUnreachable
    from aibro_jupyter import Training
    from aibro_jupyter.client import BackendClient
    from aibro_jupyter.fitrequest import FitRequest

    client = BackendClient(os.environ["AIBRO_BACKEND_URL"], os.environ["AIBRO_TOKEN"])
    cool = 0.0 if machine.startswith("local") else 30.0  # a cloud machine cools for its user's next job
    upload = client.upload_source

    def said(*a: Any, **kw: Any) -> Any:
        out = upload(*a, **kw)
        print("UPLOADED", flush=True)
        return out

    client.upload_source = said  # type: ignore[method-assign]
    trainer = Training(client)
    x, y = sl.data(rows, seed)
    if kind == "study":
        import keras_tuner as kt

        from aibro_jupyter.search import check_ended, finish, follow, given_args, start_study

        tuner = kt.RandomSearch(sl.build_model, objective="loss", max_trials=2, seed=seed, directory="tuner")
        req = FitRequest(None, x, y, machine_ids=machine, epochs=2, batch_size=64, cool_down_period_s=cool)
        try:
            sid = start_study(trainer, tuner, req, parallel=1, verbose=False, search_args=given_args(req))
        except BackendUnreachable as exc:  # started while the backend is down: refused, as a fit's submission is
            print("UNREACHABLE submit", str(exc).split(":")[0], flush=True)
            return 3
        print("STUDY", sid, flush=True)
        study = None
        while study is None:  # search.follow_to_end's steps, the follower apart from the downloads
            try:
                study = follow(trainer.client, sid, verbose=False)
            except BackendUnreachable as exc:  # the follower waits out an outage (35bcc5d): a finding if it does not
                print("FOLLOW-LOST", str(exc).split(":")[0], flush=True)
                time.sleep(2)  # then follows again, as a user would with Training.attach_study
        try:
            finish(trainer, tuner, study)  # the trials' models: downloads, which a backend outage ends (as collect)
        except BackendUnreachable as exc:
            print("UNREACHABLE collect", str(exc).split(":")[0], flush=True)
            return 3
        check_ended(study)
        return 0
    extra = [sl.DiskFill(mb=(DISK_LIMIT >> 20) + 4)] if kind == "disk" else None
    req = FitRequest(
        sl.model(seed, extra), x, y, machine_ids=machine, epochs=epochs, batch_size=32, cool_down_period_s=cool
    )
    try:
        job = trainer.submit(req)
    except BackendUnreachable as exc:  # a submission while the backend is down: refused, in words a user reads
        print("UNREACHABLE submit", str(exc).split(":")[0], flush=True)
        return 3
    print("JOB", job.job_id, flush=True)
    if kind == "fit":
        view = trainer.watch(job.job_id)  # retries with backoff while the backend is down
        if view.status == JobStatus.COMPLETED:
            try:
                trainer.collect(view)
            except BackendUnreachable as exc:  # no retry here, unlike watch: counted, the job is checked anyway
                print("UNREACHABLE collect", str(exc).split(":")[0], flush=True)
                return 3
        print("DONE", view.status, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "client"])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rows", type=int, default=None, help="rows of each job's data (3000; on AWS 22000: multipart)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--mean-gap", type=float, default=45.0, help="mean seconds between faults")
    ap.add_argument("--no-study", action="store_true")
    ap.add_argument("--schedule", default=None, help="a fixed schedule instead of the seed's: 30:kill_worker,60:...")
    ap.add_argument("--kind", default="fit")
    ap.add_argument("--machine", default="local-cpu")
    ap.add_argument("--provider", default="local", choices=["local", "aws"], help="aws: moto-backed, flaky S3")
    ap.add_argument("--keep", type=Path, default=None, help="put the home, logs and report here")
    a = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the checks load models here: no TensorFlow chatter
    if a.mode == "client":
        return client_main(a.kind, a.seed, a.epochs, a.rows or 3000, a.machine)
    cfg = Config(
        users=a.users,
        minutes=a.minutes,
        seed=a.seed,
        epochs=a.epochs,
        rows=a.rows or (ROWS_AWS if a.provider == "aws" else 3000),
        slots=a.slots,
        mean_gap_s=a.mean_gap,
        study=not a.no_study,
        schedule=[(float(t), k) for t, k in (x.split(":") for x in a.schedule.split(","))] if a.schedule else None,
        root=a.keep,
        provider=a.provider,
    )
    rep = Soak(cfg).run()
    print(rep.text())
    print("SOAK", "PASSED" if not rep.failures else f"FAILED: {', '.join(rep.failures)}")
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    sys.exit(main())
