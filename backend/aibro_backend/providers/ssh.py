"""The user's own machines over SSH (a lab server, a workstation, a rented GPU box): each host of the hosts file
(ssh_hosts.py) is offered as `ssh:<name>` (CPU) and `ssh:<name>-gpuN` (N of its GPUs).

The system's OpenSSH client does the talking, with this backend's own known_hosts file: the first contact records
a host's key and a changed key is refused, naming the host and the file (host-key checking is never off). A launch
installs the agent this backend serves (shipping.py's wheel, checked against its SHA-256) into a venv under
`~/.aibro/agent/<version>` on the host, once per version, then starts the worker detached (`setsid`), so it
outlives the SSH connection; its environment goes through a 0600 file, never a command line. A worker's folder
(`~/.aibro/workers/<instance>`: its token, the job's data, code and outputs) goes once its worker has ended, its
log kept as `~/.aibro/worker-logs/<instance>.log` for a week, as the local provider keeps it (`leftovers_script`).
A poller asks each host which of its workers still run; a host unreachable for `unreachable_grace_s` loses its
instances (their jobs resume elsewhere from the last checkpoint). What runs where is kept in
`state/ssh/instances.json`, so a restarted backend finds its workers again; stopping the backend stops them.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aibro_core.files import private_dir, write_private
from aibro_core.models import Machine

from ..storage.records import InstanceRecord
from .base import CapacityError, LaunchRequest, Provider
from .shipping import AgentWheel, install_script
from .ssh_hosts import Host

log = logging.getLogger("aibro.ssh")
REMOTE = "$HOME/.aibro"
CHANGED_KEY = "REMOTE HOST IDENTIFICATION HAS CHANGED"
STARTING_S = 600  # a worker folder with no pid beside it yet this young is a worker starting now: left alone


def leftovers_script(gone: list[str] | tuple[str, ...] = (), keep: list[str] | tuple[str, ...] = ()) -> str:
    """sh that removes worker folders on a host as the local provider does (local.remove_workdir, sweep): those of
    the `gone` instances (their worker ended: the backend ended it or saw it exit), then every other one whose worker
    is not running (its pid, in `workers/<instance>.pid`, is gone or a zombie; a folder with no pid yet only once it
    is STARTING_S old), but those of the `keep` instances (this backend's live ones). Each worker.log is kept as
    `worker-logs/<instance>.log` (0600, in a 0700 folder, never through a link the job left), and logs a week old go.
    Prints nothing."""
    ids = " ".join(shlex.quote(i) for i in gone)
    kept = " ".join(shlex.quote(i) for i in keep)
    return f"""R="{REMOTE}"; umask 077
mkdir -p "$R/worker-logs" "$R/workers"; chmod 700 "$R/worker-logs"
state() {{ sed 's/.*) //' "/proc/$1/stat" | cut -c1; }}
running() {{ [ -n "$1" ] && kill -0 "$1" 2>/dev/null && {{ [ ! -r "/proc/$1/stat" ] || [ "$(state "$1")" != Z ]; }}; }}
gone() {{
  if [ -f "$1/worker.log" ] && [ ! -L "$1/worker.log" ]; then
    mv -f "$1/worker.log" "$R/worker-logs/${{1##*/}}.log" && chmod 600 "$R/worker-logs/${{1##*/}}.log"
  fi
  rm -rf "$1" "$1.pid"
}}
for i in {ids}; do gone "$R/workers/$i"; done
for w in "$R"/workers/*; do
  [ -d "$w" ] && [ ! -L "$w" ] || {{ [ "${{w%.pid}}" != "$w" ] && [ ! -e "${{w%.pid}}" ] && rm -f "$w"; continue; }}
  case " {kept} " in *" ${{w##*/}} "*) continue ;; esac
  if [ -f "$w.pid" ]; then running "$(cat "$w.pid")" && continue
  elif [ -n "$(find "$w" -maxdepth 0 -mmin -{STARTING_S // 60})" ]; then continue; fi
  gone "$w"
done
find "$R/worker-logs" -name '*.log' -mtime +7 -exec rm -f {{}} + 2>/dev/null
true
"""


class SshError(RuntimeError):
    """What went wrong on or on the way to a host; `unreachable` when the host did not answer at all."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass
class Remote:
    """One instance on a host: what the poller and a restarted backend need."""

    host: str
    machine_id: str
    gpus: list[int] = field(default_factory=list)
    pid: int | None = None
    state: str = "launching"  # launching -> running -> exited | lost | failed | closed
    error: str | None = None
    unreachable: bool = False  # a failed start because the host did not answer: the job passes over at once


class SshProvider(Provider):
    name = "ssh"

    def __init__(
        self,
        hosts: list[Host],
        state_dir: Path,
        agent: AgentWheel,
        *,
        worker_url: str | None = None,
        poll_s: float = 10.0,
        unreachable_grace_s: float = 20.0,
        connect_timeout_s: int = 10,
    ) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.state_dir = private_dir(Path(state_dir) / "ssh")
        self.known_hosts = self.state_dir / "known_hosts"
        self.agent = agent
        self.worker_url = worker_url  # the backend as the hosts reach it (default: the URL it listens on)
        # at least four looks within the grace, and no more than one SSH connection per host every `poll_s`
        self.poll_s = min(poll_s, unreachable_grace_s / 4)
        self.grace_s, self.connect_timeout_s = unreachable_grace_s, connect_timeout_s
        self.facts: dict[str, dict[str, Any]] = {}  # per host: vcpus, memory_gib, gpu names (check())
        self._lock = threading.Lock()
        self._host_locks = {name: threading.Lock() for name in self.hosts}
        self._unreachable_since: dict[str, float] = {}
        self._remotes: dict[str, Remote] = self._load()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="aibro-ssh")
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_forever, name="aibro-ssh-poll", daemon=True)
        self._poller.start()

    # -- talking to a host -----------------------------------------------------------------------------------
    def _argv(self, host: Host) -> list[str]:
        return [
            "ssh",
            *("-i", host.identity_file, "-p", str(host.port)),
            *("-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={self.connect_timeout_s}"),
            *("-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=accept-new"),
            *("-o", "GlobalKnownHostsFile=/dev/null", "-o", "ServerAliveInterval=10", "-o", "LogLevel=ERROR"),
            f"{host.user}@{host.host}",
        ]

    def run(self, host: Host, script: str, *, stdin: bytes | None = None, timeout: float = 120) -> str:
        """Run a POSIX sh script on the host; its stdout, or SshError naming the host and what went wrong."""
        try:
            done = subprocess.run(
                [*self._argv(host), "sh -c " + shlex.quote(script)],
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise SshError(
                f"{host.name} ({host.host}:{host.port}) did not answer over SSH in {timeout:g} s", True
            ) from None
        err = done.stderr.decode(errors="replace").strip()
        if CHANGED_KEY in err:
            raise SshError(
                f"the SSH host key of {host.name} ({host.host}:{host.port}) changed since it was first recorded: "
                f"refused. If the host was really reinstalled, remove its line from {self.known_hosts}"
            )
        if done.returncode == 255:
            raise SshError(
                f"cannot reach {host.name} over SSH ({host.user}@{host.host}:{host.port}): {err[-300:]}", True
            )
        if done.returncode != 0:
            raise SshError(f"on {host.name}: {err[-500:] or f'exit {done.returncode}'}")
        return done.stdout.decode(errors="replace")

    def check(self) -> list[str]:
        """Log in to every host (recording its key on first contact) and learn its CPUs, memory and GPUs; the
        problems, one per host that cannot be used."""
        problems = []
        probe = (
            "python3 -c 'import sys; assert sys.version_info >= (3, 10), sys.version' || exit 7; nproc; "
            "awk '/MemTotal/ {print $2}' /proc/meminfo; "
            "command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader || true"
        )
        for host in self.hosts.values():
            sweep = leftovers_script(keep=self._live_on(host.name))  # what workers of before left there
            try:
                lines = self.run(host, f"{{ {sweep}\n}} >/dev/null 2>&1; {probe}", timeout=60).splitlines()
            except SshError as exc:
                problems.append(str(exc).replace("exit 7", "its python3 is missing or older than 3.10"))
                continue
            gpu_names = [line.strip() for line in lines[2:] if line.strip()]
            if host.gpus is not None:
                gpu_names = (gpu_names + ["GPU"] * host.gpus)[: host.gpus]
            self.facts[host.name] = {
                "vcpus": int(lines[0]),
                "memory_gib": round(int(lines[1]) / 1024**2, 1),
                "gpus": gpu_names,
            }
        return problems

    # -- the contract --------------------------------------------------------------------------------------
    def offers(self) -> list[Machine]:
        out = []
        for name, host in self.hosts.items():
            facts = self.facts.get(name, {"vcpus": 1, "memory_gib": 0.0, "gpus": []})
            base: dict[str, Any] = {
                "provider": self.name,
                "vcpus": facts["vcpus"],
                "memory_gib": facts["memory_gib"],
                "price_per_hour": 0.0,
                "on_demand_price_per_hour": 0.0,
                "spot": False,
                "availability": "available",
                "capacity": host.max_jobs,
            }
            out.append(Machine(**base, machine_id=f"ssh:{name}", gpu_type=None, gpu_count=0))
            for n in range(1, len(facts["gpus"]) + 1):
                out.append(Machine(**base, machine_id=f"ssh:{name}-gpu{n}", gpu_type=facts["gpus"][0], gpu_count=n))
        return out

    def launch(self, request: LaunchRequest) -> int | None:
        instance_id, machine_id = request.instance_id, request.machine_id
        name, _, gpu = machine_id.removeprefix("ssh:").partition("-gpu")
        host = self.hosts.get(name)
        if host is None:
            raise ValueError(f"{machine_id} is not a host of this backend's hosts file")
        with self._lock:
            on_host = [r for r in self._remotes.values() if r.host == name and r.state in ("launching", "running")]
            if len(on_host) >= host.max_jobs:
                raise CapacityError(f"{name} runs {len(on_host)} jobs, its max_jobs")
            taken = {g for r in on_host for g in r.gpus}
            free = [g for g in range(len(self.facts.get(name, {}).get("gpus", []))) if g not in taken]
            want = int(gpu) if gpu else 0
            if len(free) < want:
                raise CapacityError(f"{name} has {len(free)} GPUs free, not {want}")
            remote = Remote(name, machine_id, free[:want])
            self._remotes[instance_id] = remote
            self._save()
        self._pool.submit(self._start, instance_id, host, remote, dict(request.env), request.tensorflow)
        return None

    def alive(self, instance: InstanceRecord) -> bool:
        remote = self._remotes.get(instance.id)
        return remote is not None and remote.state in ("launching", "running")

    def launch_error(self, instance_id: str) -> BaseException | None:
        remote = self._remotes.get(instance_id)
        if remote is None or remote.state != "failed":
            return None
        return CapacityError(remote.error) if remote.unreachable else SshError(str(remote.error))

    def pending(self, instance: InstanceRecord) -> str | None:
        remote = self._remotes.get(instance.id)
        if remote is not None and remote.state == "launching":
            return f"installing the agent on {remote.host} (once per version) and starting it"
        return None

    def lost_reason(self, instance: InstanceRecord) -> str | None:
        remote = self._remotes.get(instance.id)
        return remote.error if remote is not None else None

    def info(self, instance: InstanceRecord) -> dict[str, Any]:
        remote = self._remotes.get(instance.id)
        if remote is None:
            return {}
        host = self.hosts.get(remote.host)
        return {"host": remote.host, "address": f"{host.host}:{host.port}" if host else "", "pid": remote.pid}

    def terminate(self, instance: InstanceRecord) -> Future | None:
        return self._pool.submit(self._end, instance.id)

    def close(self) -> None:
        """The backend stops: its workers stop with it (a restarted backend starts new ones for its jobs)."""
        self._stop.set()
        running = [i for i, r in self._remotes.items() if r.state in ("launching", "running")]
        log.info("stopping %d worker(s) on the SSH hosts", len(running))
        for fut in [self._pool.submit(self._end, i) for i in running]:
            try:
                fut.result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - one host down must not keep the others' workers
                log.warning("could not stop a worker: %s", exc)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- launching and ending -----------------------------------------------------------------------------------
    def _install(self, host: Host, tensorflow: str | None) -> None:
        """The served agent in a venv on the host, once per version (shipping.install_script): TensorFlow from the
        host's Python, or at `tensorflow` (the first job's kernel's major.minor) where it has none."""
        if self.run(host, f'cat "{self._agent_dir}/agent-version" 2>/dev/null || true').strip() == self.agent.version:
            return  # nothing to send
        script = "set -eu; umask 077\n" + install_script(self.agent, self._agent_dir, 'cat > "$part"', tensorflow)
        self.run(host, script, stdin=self.agent.path.read_bytes(), timeout=1800)

    @property
    def _agent_dir(self) -> str:
        return f"{REMOTE}/agent/{self.agent.version}"  # per version: a worker adopted after a crash keeps its code

    def _start(self, instance_id: str, host: Host, remote: Remote, env: dict[str, str], tensorflow: str | None) -> None:
        try:
            with self._host_locks[host.name]:  # one install per host at a time
                self._install(host, tensorflow)
            if self.worker_url:
                env["AIBRO_WORKER_URL"] = self.worker_url
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, remote.gpus)) or "-1"
            lines = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
            sweep = leftovers_script(keep=self._live_on(host.name))  # each start cleans what ended there
            script = f"""{{ {sweep}
}} >/dev/null 2>&1
set -eu
w="{REMOTE}/workers/{instance_id}"; umask 077; mkdir -p "$w" "{REMOTE}/envs"
cat > "$w/env"
cd "$w"
set -a; . "$w/env"; AIBRO_WORKER_DIR="$w"; AIBRO_ENV_CACHE="{REMOTE}/envs"; set +a
py="{self._agent_dir}/venv/bin/python"
setsid "$py" -I -m aibro_backend.worker > "$w/worker.log" 2>&1 < /dev/null &
echo $! > "$w.pid"
echo $!
"""
            pid = int(self.run(host, script, stdin=lines.encode()).strip().splitlines()[-1])
        except (SshError, ValueError, IndexError) as exc:
            with self._lock:
                remote.state, remote.error = "failed", f"could not start a worker on {host.name}: {exc}"
                remote.unreachable = isinstance(exc, SshError) and exc.unreachable
                self._save()
            log.warning("%s", remote.error)
            return
        with self._lock:
            if remote.state == "launching":
                remote.pid, remote.state = pid, "running"
            self._save()
        if remote.state == "closed":  # terminated while it started
            self._end(instance_id)

    def _end(self, instance_id: str) -> None:
        with self._lock:
            remote = self._remotes.get(instance_id)
            if remote is None:
                return
            pid, was = remote.pid, remote.state
            remote.state = "closed"
            self._save()
        host = self.hosts.get(remote.host)
        if pid is None or host is None or was in ("exited", "failed"):
            return  # an exited worker's folder went when the poller saw it exit; a failed start's goes at the next
        log.info("stopping %s on %s (pid %s)", instance_id, host.name, pid)  # its process group: setsid made it
        stop = f"kill -TERM -{pid} 2>/dev/null; sleep 2; kill -KILL -{pid} 2>/dev/null; true"
        self.run(host, f"{stop}\n{leftovers_script(gone=[instance_id], keep=self._live_on(host.name))}", timeout=60)

    def _live_on(self, host: str) -> list[str]:
        """This backend's instances that are starting or running on `host`: their folders stay."""
        with self._lock:
            return [i for i, r in self._remotes.items() if r.host == host and r.state in ("launching", "running")]

    # -- watching ----------------------------------------------------------------------------------------------
    def _poll_forever(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name in list(self.hosts):
                try:
                    self._poll(name)
                except Exception:  # noqa: BLE001 - one host's trouble never stops the watching of the others
                    log.exception("polling %s failed", name)

    def _poll(self, name: str) -> None:
        with self._lock:
            running = {i: r for i, r in self._remotes.items() if r.host == name and r.state == "running" and r.pid}
        if not running:
            self._unreachable_since.pop(name, None)
            return
        pids = " ".join(str(r.pid) for r in running.values())
        try:
            out = self.run(
                self.hosts[name], f"for p in {pids}; do kill -0 $p 2>/dev/null && echo $p; done; true", timeout=30
            )
        except SshError as exc:
            since = self._unreachable_since.setdefault(name, time.monotonic())
            if time.monotonic() - since >= self.grace_s:
                self._mark(running, "lost", f"{exc} for {time.monotonic() - since:.0f} s")
            return
        self._unreachable_since.pop(name, None)
        up = {int(p) for p in out.split()}
        exited = {i: r for i, r in running.items() if r.pid not in up}
        self._mark(exited, "exited", "the worker exited")
        if exited:  # their folders go now, their logs kept
            try:
                self.run(self.hosts[name], leftovers_script(gone=list(exited), keep=self._live_on(name)), timeout=60)
            except SshError as exc:
                log.warning("could not remove the folders of %s on %s (the next start there does): %s",
                            ", ".join(exited), name, exc)  # fmt: skip

    def _mark(self, remotes: dict[str, Remote], state: str, why: str) -> None:
        if not remotes:
            return
        with self._lock:
            for instance_id, remote in remotes.items():
                if remote.state == "running":
                    remote.state, remote.error = state, why
                    log.warning("%s on %s: %s", instance_id, remote.host, why)
            self._save()

    # -- what runs where, across restarts ------------------------------------------------------------------------
    def _load(self) -> dict[str, Remote]:
        path = self.state_dir / "instances.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        remotes = {i: Remote(**r) for i, r in raw.items() if r.get("host") in self.hosts}
        for remote in remotes.values():
            if remote.state == "launching":  # the backend stopped while it started: that start is lost
                remote.state, remote.error = "failed", "the backend restarted while this worker started"
        return remotes

    def _save(self) -> None:
        live = {i: asdict(r) for i, r in self._remotes.items() if r.state in ("launching", "running")}
        write_private(self.state_dir / "instances.json", live)
