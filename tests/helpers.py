"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aibro_jupyter.client import BackendClient


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose aibro home is `home` (never a configured backend from the outer shell)."""
    env = {k: val for k, val in os.environ.items() if k not in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    return {**env, "AIBRO_HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def run_as_user(home: Path, args: list[str], timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    """Run a command the way a user with aibro home `home` would."""
    return subprocess.run(args, env=user_env(home, **extra), capture_output=True, text=True, timeout=timeout)


def aibro_cli(home: Path, *args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    """Run the `aibro` CLI as a user would, against the backend under `home`."""
    return run_as_user(home, [sys.executable, "-m", "aibro_jupyter.cli", *args], timeout, **extra)


def backend_db(home: Path, sql: str, *params: Any) -> list[tuple]:
    """Rows from the backend's own database (for what the API never shows: pids, worker numbering, WAL mode)."""
    db = sqlite3.connect(str(home / "state" / "aibro.db"))
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def instance_pid(home: Path, instance_id: str) -> int:
    """The worker's pid, read from the backend's own database (the API never shows pids)."""
    return int(backend_db(home, "SELECT pid FROM instances WHERE id=?", instance_id)[0][0])


def wait_for(client: BackendClient, job_id: str, pred: Any, timeout: float = 300) -> list[dict[str, Any]]:
    """Follow a job's events until `pred(events)` holds; returns the events seen so far."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        after = events[-1]["seq"] if events else 0
        page = client.events(job_id, after, wait=2)
        events += page["events"]
        if pred(events):
            return events
    raise AssertionError(f"condition not reached for {job_id}; last events: {events[-3:]}")


def answered_again(call: Callable[[], Any], refused: type[BaseException] = Exception, within_s: float = 10) -> Any:
    """`call()`'s answer once it stops being refused (a backend counting closed connections down frees its
    cap a moment after they close); the last refusal is raised after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except refused:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def wait_until(cond: Callable[[], Any], timeout: float = 300) -> Any:
    """`cond()`'s first true value, or None after `timeout`: for a state the backend reaches by itself (the bound
    only stops a hang)."""
    deadline = time.monotonic() + timeout
    while not (found := cond()):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return found


def epochs_seen(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["type"] == "epoch"]


def slow_data(n: int = 6000, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic but learnable data, sized so one epoch at batch 16 takes about a second here."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64)).astype("float32")
    w = rng.normal(size=(64, 10)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int32")
    return x, y


def pids_where(argv_test: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids of this host's processes whose command line (argv, as bytes) passes `argv_test`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv_test(argv):
                found.append(int(proc.name))
    return found


def find_worker_process(pid: int) -> int | None:
    """The worker's own Python process: `pid` itself, or, when the worker is sandboxed, the process bubblewrap
    (whose pid the backend keeps) started inside its namespaces; None when there is none (yet)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    todo = [pid]
    while todo:
        cur = todo.pop(0)
        try:
            cmd = (Path(f"/proc/{cur}/cmdline").read_bytes()).split(b"\0")
        except OSError:
            continue
        if (
            cmd
            and cmd[0] != b"bwrap"
            and any(c in (b"aibro_backend.worker", b"aibro_backend.worker.spare") for c in cmd)
        ):
            return cur
        todo += children.get(cur, [])
    return None


def worker_process(pid: int) -> int:
    """`find_worker_process` for a worker that must be there."""
    found = find_worker_process(pid)
    if found is None:
        raise AssertionError(f"no worker process under pid {pid}")
    return found


def user_data_config() -> Any:
    """An `AwsConfig` with every field a machine's user data reads, for tests of the user data alone."""
    from aibro_backend.providers.aws_config import AwsConfig

    return AwsConfig.model_construct(
        region="us-east-1",
        subnet_id="subnet-1",
        security_group_ids=("sg-1",),
        s3_bucket="bucket",
        instance_profile="profile",
        backend_public_url="https://aibro.example.test:8888",
    )
