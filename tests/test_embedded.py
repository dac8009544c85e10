"""The embedded default: the first client starts a detached daemon that outlives it; later clients reuse it."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import backend_db, run_as_user

pytestmark = pytest.mark.fast

PROBE = "from aibro_jupyter import config; t = config.resolve(); print(t.url)"


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess:
    return run_as_user(home, args, timeout=120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def home(tmp_path: Path):
    h = tmp_path / "aibro"
    yield h
    _run([sys.executable, "-m", "aibro_jupyter.cli", "backend", "stop"], h)


def test_first_client_starts_a_daemon_that_outlives_it(home: Path) -> None:
    first = _run([sys.executable, "-c", PROBE], home)
    assert first.returncode == 0, first.stderr
    url = first.stdout.strip()
    assert url.startswith("http://127.0.0.1:")
    info = json.loads((home / "backend.json").read_text())
    assert info["url"] == url and _alive(info["pid"]), "the daemon runs on after its first client exited"
    assert os.getsid(info["pid"]) == info["pid"], "the daemon leads its own session (detached from the client)"
    for name in ("backend.json", "credentials.json"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    token = json.loads((home / "credentials.json").read_text())["token"]
    assert len(token) >= 32

    assert backend_db(home, "PRAGMA journal_mode") == [("wal",)], "the store runs in WAL mode"

    second = _run([sys.executable, "-c", PROBE], home)
    assert second.stdout.strip() == url
    assert json.loads((home / "backend.json").read_text())["pid"] == info["pid"], "later clients reuse it"


def test_backend_cli_status_and_stop(home: Path) -> None:
    installed = shutil.which("aibro")
    assert installed, "pip install puts an `aibro` command on PATH"
    aibro = [installed]
    stray = _run([*aibro, "backend", "stop", "bob"], home)
    assert stray.returncode == 2 and "takes no name" in stray.stderr, stray.stderr
    down = _run([*aibro, "backend", "status"], home)
    assert down.returncode == 3 and "no backend running" in down.stdout
    started = _run([*aibro, "backend", "start"], home)
    assert started.returncode == 0 and "running at http://127.0.0.1:" in started.stdout
    pid = json.loads((home / "backend.json").read_text())["pid"]
    status = _run([*aibro, "backend", "status"], home)
    assert status.returncode == 0 and "ok, user local" in status.stdout
    machines = _run([*aibro, "machines"], home)
    assert "local-cpu" in machines.stdout
    jobs = _run([*aibro, "jobs"], home)
    assert jobs.returncode == 0 and "job_id" in jobs.stdout
    stopped = _run([*aibro, "backend", "stop"], home)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not _alive(pid)
    assert _run([*aibro, "backend", "status"], home).returncode == 3


def test_status_and_instances_name_the_process_its_workers_and_the_spare(home: Path) -> None:
    """Issue 28 item 5: `aibro backend status` says where the embedded backend runs (pid, home, log), the sandbox
    and its workers with their memory; `aibro instances` has a header and shows the spare worker as such."""
    cli = [sys.executable, "-m", "aibro_jupyter.cli"]
    assert run_as_user(home, [*cli, "backend", "start"], timeout=120, AIBRO_SPARE_WORKER="1").returncode == 0
    pid = json.loads((home / "backend.json").read_text())["pid"]
    deadline = time.monotonic() + 300
    while "(spare)" not in (listed := _run([*cli, "instances"], home)).stdout:
        assert time.monotonic() < deadline, listed.stdout + listed.stderr
        time.sleep(0.5)
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["instance", "machine", "status", "substatus", "note"], lines
    assert lines[-1].split()[:3] == ["(spare)", "local-cpu", "READY"] and "spare worker" in lines[-1], lines
    status = _run([*cli, "backend", "status"], home)
    out = status.stdout
    assert status.returncode == 0 and f"pid {pid}, home {home}, log {home / 'backend.log'}" in out, out
    assert re.search(r"^sandbox: (bwrap|none)", out, re.M) and "workers: 1" in out, out
    spare = re.search(r"^  pid (\d+) +(\d+) MiB  spare worker$", out, re.M)
    assert spare and int(spare.group(2)) > 50, f"the spare holds TensorFlow: {out}"


def test_cli_reports_a_wrong_token_clearly(home: Path) -> None:
    env_home = home
    _run([sys.executable, "-m", "aibro_jupyter.cli", "backend", "start"], env_home)
    url = json.loads((home / "backend.json").read_text())["url"]
    env = {**os.environ, "AIBRO_HOME": str(home), "AIBRO_BACKEND_URL": url, "AIBRO_TOKEN": "wrong"}
    res = subprocess.run([sys.executable, "-m", "aibro_jupyter.cli", "jobs"], capture_output=True, text=True, env=env)
    assert res.returncode == 2
    assert "rejected the token" in res.stderr and "aibro login" in res.stderr
