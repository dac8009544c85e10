"""A backend of a test's own: `python -m aibro_backend --home H --port 0` with its own settings, stopped afterwards."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aibro_jupyter.client import BackendClient

from conftest import kill_workers
from helpers import user_env


@dataclass
class OwnBackend:
    home: Path
    proc: subprocess.Popen
    url: str
    token: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, token: str | None = None) -> BackendClient:
        return BackendClient(self.url, token or self.token)

    def add_user(self, name: str) -> BackendClient:
        """A second user, made as an admin would (`aibro backend add-user NAME`), and a client with their token."""
        made = subprocess.run(
            [sys.executable, "-m", "aibro_backend.server.accounts", "add-user", name, "--home", str(self.home)],
            env=user_env(self.home),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        return self.client(re.search(r"--token=(\S+)", made.stdout).group(1))

    def rss_kib(self) -> int:
        """The backend's resident memory now, from /proc (VmRSS, KiB)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the backend has used so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def own_backend(home: Path, *args: str, preexec: Callable[[], None] | None = None, **env: str) -> Iterator[OwnBackend]:
    """Start a backend under `home` (log beside it, not in it), wait until it listens, stop it afterwards."""
    home.mkdir(parents=True, exist_ok=True)
    log = home.with_name(home.name + ".log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0", *args],
            env=user_env(home, **env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the backend exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the backend did not start: {log.read_text()[-3000:]}"
            try:
                info = json.loads((home / "backend.json").read_text())
                token = json.loads((home / "credentials.json").read_text())["token"]
                if info.get("pid") == proc.pid:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        yield OwnBackend(home, proc, info["url"], token, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        kill_workers(home)


def raise_fd_limit(want: int) -> None:
    """Let this test process hold `want` descriptors (sockets) at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
