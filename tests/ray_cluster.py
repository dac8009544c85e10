"""A real Ray cluster on this host for the Ray tests: a head and worker nodes, each started by `ray start` in a
process session of its own, with --num-cpus 1, its own ports and its own temp dir under /tmp.

Cluster hygiene (2 shared cores, other engineers' tests beside these): teardown SIGKILLs exactly this cluster's
sessions, never `ray stop` (it kills every Ray process on the host by name, whatever --temp-dir they use). Tests
never call `ray.init` in their own process: a driver whose cluster is stopped is terminated by Ray 60 s later.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

POOL = "aibro-node"  # the custom resource that marks the nodes aibro may use (the head has none)
SECRET = "backend-secret-that-no-worker-may-see"


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all held open together while they are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    return free_ports(1)[0]


def node_ports(extra: int = 0) -> tuple[list[str], list[int]]:
    """Every port a node binds, given explicitly: nodes started at once on one host otherwise race for the same
    random ports ("bind: Address already in use")."""
    ports = free_ports(6 + 12 + extra)
    flags = ["--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port"]
    flags += ["--dashboard-agent-grpc-port", "--dashboard-agent-listen-port"]
    args = [x for flag, port in zip(flags, ports) for x in (flag, str(port))]
    args += ["--worker-port-list", ",".join(map(str, ports[6:18]))]
    return args, ports[18:]


def ray_available() -> None:
    """Fail (never skip) when Ray is missing: these tests are the only proof the provider works."""
    if shutil.which("ray") is None or importlib.util.find_spec("ray") is None:
        pytest.fail('Ray is not installed: pip install "ray[default]>=2.9" (it is in the test extra)')


class RayCluster:
    """Ray nodes on this host, each started by `ray start` in a session of its own."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="aibro-ray-", dir="/tmp")  # short: Ray's socket paths must fit
        self.sessions: dict[str, int] = {}
        self.address = ""
        self.client_address = ""
        self.timings: dict[str, float] = {}
        # The raylets' environment is what actors inherit: a backend secret in it must never reach a worker.
        # CUDA_VISIBLE_DEVICES is left out: Ray maps a node's GPU ids through it, and a runner's "-1" (no GPU
        # here) would turn the fake GPU node's "0" into "-1".
        self.env = {
            **{k: val for k, val in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
            "RAY_TMPDIR": self.tmp,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_raylet_start_wait_time_s": "150",  # a loaded 2-core box: a node registers slowly (default 10 s)
            "AIBRO_TOKEN": SECRET,
        }

    def _start(
        self, name: str, make_args: Callable[[], list[str]], attempts: int = 2, bin_dir: Path | None = None
    ) -> None:
        """`ray start` for one node, with fresh ports and a fresh temp dir on a second try: on a loaded host a
        port picked free can be taken before Ray binds it, and the node then never registers."""
        t0 = time.monotonic()
        for attempt in range(attempts):
            logf = Path(self.tmp) / f"{name}-{attempt}.log"
            tmp = Path(self.tmp) / name  # a temp dir per node: nodes started at once would race for socket names
            tmp.mkdir()
            ray = str(bin_dir / "ray") if bin_dir else "ray"
            cmd = [ray, "start", "--disable-usage-stats", "--temp-dir", str(tmp), "--include-log-monitor=false"]
            env = self.env
            if bin_dir is not None:  # a node whose Python is another venv's: its raylet and workers run that one
                env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent)}
            with open(logf, "wb") as out:
                proc = subprocess.Popen(
                    [*cmd, *make_args()], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            self.sessions[name] = proc.pid
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                code = None
            if code == 0:
                self.timings[name] = time.monotonic() - t0
                return
            why = f"ray start for {name} failed ({code}):\n{logf.read_text()[-1500:]}\n{self._log_tails(tmp)}"
            self._kill_session(proc.pid)
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"\n{why}\n(attempt {attempt + 1} of {attempts})")
        raise RuntimeError(why)

    @staticmethod
    def _log_tails(tmp: Path) -> str:
        logs = tmp / "session_latest" / "logs"
        out = []
        for name in ("raylet.out", "raylet.err", "gcs_server.err"):
            with contextlib.suppress(OSError):
                out.append(f"-- {name}:\n" + "\n".join((logs / name).read_text().splitlines()[-12:]))
        return "\n".join(out)

    def _kill_session(self, sid: int) -> None:
        for pid in self.processes({sid}):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def head(self) -> None:
        ports: list[int] = []

        def args() -> list[str]:
            flags, (gcs, client, dashboard) = node_ports(3)
            ports[:] = [gcs, client, dashboard]
            flags += ["--port", str(gcs), "--ray-client-server-port", str(client), "--dashboard-port", str(dashboard)]
            return [
                "--head",
                *flags,
                *("--include-dashboard=false", "--num-cpus", "1", "--resources", json.dumps({"aibro-test": 1})),
            ]

        self._start("head", args)
        self.client_address = f"ray://127.0.0.1:{ports[1]}"
        self.address = (Path(self.tmp) / "head" / "ray_current_cluster").read_text().strip()

    def node(
        self, name: str, gpus: int = 0, resources: dict[str, float] | None = None, bin_dir: Path | None = None
    ) -> None:
        """`bin_dir`: the venv whose `ray start` (and so whose Python) runs this node; the test's own by default."""

        def args() -> list[str]:
            flags, _ = node_ports()
            flags += ["--address", self.address, "--num-cpus", "1"]
            flags += ["--resources", json.dumps({POOL: 1, name: 1, **(resources or {})})]
            if gpus:
                flags += ["--num-gpus", str(gpus)]  # Ray takes the count as given: a GPU node without a GPU
            return flags

        self._start(name, args, bin_dir=bin_dir)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a node's `ray start` process group (raylet, agents; its workers notice and exit)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sessions[name], sig)

    def processes(self, sessions: set[int] | None = None) -> list[int]:
        """Every process in one of this cluster's sessions (Ray workers have process groups of their own)."""
        mine = sessions or set(self.sessions.values())
        out = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                    if int(stat[3]) in mine:  # field 6 of /proc/PID/stat: the session id
                        out.append(int(proc.name))
        return out

    def stop(self) -> None:
        for name in self.sessions:
            self.kill(name)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = self.processes()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def start_cluster(nodes: dict[str, dict[str, Any]]) -> Iterator[RayCluster]:
    """A head and the named worker nodes (keyword arguments of `RayCluster.node`), started at once; stopped after."""
    ray_available()
    c = RayCluster()
    try:
        c.head()
        errors: list[BaseException] = []

        def start(name: str, kw: dict[str, Any]) -> None:
            try:
                c.node(name, **kw)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(name, kw)) for name, kw in nodes.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        print(f"\nray start timings (s): {', '.join(f'{k} {val:.1f}' for k, val in c.timings.items())}")
        yield c
    finally:
        c.stop()
