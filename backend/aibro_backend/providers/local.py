"""The embedded default provider: each instance is an `aibro worker` process on this host, at cost 0."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aibro_core.files import open_private_log, private_dir

from ..storage.records import InstanceRecord
from ..worker.jobprocs import descendants
from ..worker.netbridge import BRIDGE_ENV
from . import jobnet
from .base import LaunchRequest, Provider
from .sandbox import Sandbox
from .spare import MODULE as SPARE_MODULE
from .spare import SPARE_DELAY_S, SPARE_MACHINE, Spare, SpareCrashes

if TYPE_CHECKING:
    from aibro_core.models import Machine

log = logging.getLogger("aibro.local")

# What a worker inherits from the backend's own environment: what any process needs, the host's network settings
# (proxies, CA bundles: the worker's pip installs a job's requirements) and the TensorFlow / GPU knobs an operator
# may set for training. Nothing else: not PYTHONPATH (the client's or the notebook's folders), not AIBRO_HOME /
# AIBRO_TOKEN / AIBRO_BACKEND_URL (the backend's state and credentials), not whatever else the first client that
# started an embedded backend happened to have in its environment.
_PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
INHERITED = frozenset(
    {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "TF_CPP_MIN_LOG_LEVEL", "LD_LIBRARY_PATH", "OMP_NUM_THREADS"}
    | {"SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"}
    | {"AIBRO_CPU_DEVICES"}  # the worker splits its CPU into this many devices (MirroredStrategy with no GPU)
    | {*_PROXIES, *(p.lower() for p in _PROXIES)}
)
INHERITED_PREFIXES = ("TF_", "CUDA_", "NVIDIA_", "XLA_", "AIBRO_JOB_")  # AIBRO_JOB_MAX_*: worker/joblimits.py
# What the scheduler may hand a worker in launch(env): where and how to reach the backend, its instance id, the
# per-hash environment cache, and the memory its jobs may hold (scheduling/jobmemory.py: over the operator's setting
# the worker inherits, as it may differ per machine).
FROM_SCHEDULER = frozenset({"AIBRO_INSTANCE_ID", "AIBRO_ENV_CACHE", "AIBRO_ENROLL_TOKEN", "AIBRO_JOB_MAX_MEMORY_BYTES"})
FROM_SCHEDULER_PREFIXES = ("AIBRO_WORKER_",)


def worker_env(
    inherited: Mapping[str, str], scheduled: Mapping[str, str], workdir: Path, visible_devices: str
) -> dict[str, str]:
    """A worker's whole environment, built from allow-lists (never `{**os.environ, ...}`)."""
    env = {k: val for k, val in inherited.items() if k in INHERITED or k.startswith(INHERITED_PREFIXES)}
    env.update((k, val) for k, val in scheduled.items() if k in FROM_SCHEDULER or k.startswith(FROM_SCHEDULER_PREFIXES))
    env["AIBRO_WORKER_DIR"] = str(workdir)
    env["CUDA_VISIBLE_DEVICES"] = visible_devices
    if inherited.get("AIBRO_CA_BUNDLE"):  # how it verifies an HTTPS backend: a copy inside what it can see
        env["AIBRO_CA_BUNDLE"] = str(_copy_ca_bundle(Path(inherited["AIBRO_CA_BUNDLE"]), workdir))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _copy_ca_bundle(source: Path, workdir: Path) -> Path:
    """The backend's CA bundle (AIBRO_CA_BUNDLE, set by `serve --ca-bundle`) copied into the worker's own
    directory, the one place a sandboxed worker surely reads; certificates are public, so 0644."""
    dest = workdir / "ca-bundle.pem"
    dest.write_bytes(source.read_bytes())
    dest.chmod(0o644)
    return dest


def worker_python(configured: str | None) -> str:
    """The interpreter workers run: AIBRO_WORKER_PYTHON when the backend has it set, else the backend's own."""
    if not configured:
        return sys.executable
    found = shutil.which(configured)
    if not found:
        raise ValueError(
            f"AIBRO_WORKER_PYTHON={configured!r} is not an executable Python interpreter: point it at the "
            "python of an environment where the worker agent is installed (`pip install ./backend`), or unset it"
        )
    return os.path.abspath(found)  # not resolved: a venv's python is a symlink that must stay the venv's


def memory_bytes() -> int:
    """This host's memory (MemTotal), 0 where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _memory_gib() -> float:
    return round(memory_bytes() / 2**30, 1)


def _gpus() -> list[str]:
    """GPU names from nvidia-smi, without importing TensorFlow into the backend."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines() if line.startswith("GPU ")]


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs and is not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


WORKER_LOGS = "worker-logs"  # <state>/worker-logs/<instance>.log: what a closed instance's worker printed
WORKER_LOG_KEEP_S = 7 * 86400  # then it goes too


def remove_workdir(workdir: Path | None, logs: Path) -> None:
    """A closed instance's folder goes whole: its inputs, code, caches, token and outputs. Its worker.log (why a
    worker was lost) is kept for the operator as `logs/<instance>.log`, 0600 in a 0700 folder, for a week."""
    if workdir is None or not (workdir.exists() or workdir.is_symlink()):
        return
    real = workdir.resolve()  # a spare's folder, linked under the instance's name
    printed = real / "worker.log"
    if printed.is_file() and not printed.is_symlink():  # the job's code owns the folder: follow nothing it left
        kept = private_dir(logs) / f"{workdir.name}.log"
        try:
            os.replace(printed, kept)
            os.chmod(kept, 0o600)  # whoever wrote it last (the job's code could have replaced the backend's)
        except OSError as exc:
            log.warning("could not keep %s (%s); it goes with its folder", printed, exc)
    if real.is_dir():
        shutil.rmtree(real, ignore_errors=True)
    else:
        real.unlink(missing_ok=True)
    if workdir.is_symlink():
        workdir.unlink(missing_ok=True)


def drop_old_logs(logs: Path) -> None:
    """The kept logs of instances closed over WORKER_LOG_KEEP_S ago go."""
    cutoff = time.time() - WORKER_LOG_KEEP_S
    for old in logs.glob("*.log") if logs.is_dir() else ():
        with contextlib.suppress(OSError):
            if old.lstat().st_mtime < cutoff:
                old.unlink()


class LocalProvider(Provider):
    """Offers what this host really has: its CPUs as `local-cpu`, and each GPU as `local-gpuN`.

    Each instance is a worker process `python -I -m aibro_backend.worker` in a fresh private directory
    (`<state>/workers/<instance>/`, also its cwd, removed when the instance closes: `remove_workdir`, `sweep`),
    whose environment holds only the allow-listed basics and
    TensorFlow/GPU knobs (see `worker_env`): a worker never sees the client's files, packages or PYTHONPATH, nor
    the backend's state or credentials. Isolated mode (`-I`) keeps PYTHONPATH, the user site and the cwd off its
    sys.path.

    Environment of the backend read here, when the provider is built:

    * `AIBRO_LOCAL_ENROLL=1`: workers start with a one-time enrollment token instead of their worker token and
      enroll (POST /worker/enroll) as a cloud machine does; the token they get is kept in `<workdir>/worker-token`.
    * `AIBRO_WORKER_PYTHON`: the interpreter workers run (default: the backend's own, `sys.executable`). Point
      it at the python of a separate environment that holds only the worker agent (`pip install ./backend`) to
      keep the notebook stack, and anything else installed next to the backend, away from users' jobs.
    """

    name = "local"

    def __init__(self, state_dir: Path, capacity: int | None = None, spare: bool = False) -> None:
        self.state_dir = Path(state_dir)
        self.spare_on = spare  # keep a spare worker with TensorFlow imported (providers/spare.py)
        self._spare: Spare | None = None
        self._spare_crashes = SpareCrashes()
        self._prime_later: tuple[int, float] | None = None  # (user, when): the spare to start after a handover
        from ..settings import BackendSettings  # here, not above: a Ray node's actor imports this module

        settings = BackendSettings.from_env()
        self.python = worker_python(settings.worker_python)
        self.sandbox = Sandbox.choose(self.python)
        self.net_dir = jobnet.socket_dir(self.state_dir) if jobnet.isolated(self.sandbox.kind, os.environ) else None
        self.capacity = capacity or max(1, os.cpu_count() or 1)
        self._procs: dict[int, subprocess.Popen] = {}
        self._workdirs: dict[int, Path] = {}  # an instance's folder, removed once its worker has exited
        self.logs = self.state_dir / WORKER_LOGS
        self._gpu_names = _gpus()
        self.enrolls = settings.local_enroll

    def offers(self) -> list[Machine]:
        from aibro_core.models import Machine  # here, not above: a Ray node's actor imports this module

        base: dict[str, Any] = {
            "provider": self.name,
            "vcpus": os.cpu_count() or 1,
            "memory_gib": _memory_gib(),
            "price_per_hour": 0.0,
            "on_demand_price_per_hour": 0.0,
            "spot": False,
            "availability": "available",
        }
        offers = [Machine(**base, machine_id="local-cpu", gpu_type=None, gpu_count=0, capacity=self.capacity)]
        for i, name in enumerate(self._gpu_names):
            offers.append(Machine(**base, machine_id=f"local-gpu{i}", gpu_type=name, gpu_count=1, capacity=1))
        if len(self._gpu_names) > 1:
            gpus = len(self._gpu_names)
            offers.append(
                Machine(**base, machine_id="local-gpu-all", gpu_type=self._gpu_names[0], gpu_count=gpus, capacity=1)
            )
        return offers

    def slots(self) -> int:
        """The jobs this host's machines run at once: the CPU machine's capacity, one per GPU machine."""
        return sum(offer.capacity or 1 for offer in self.offers())

    def _visible_devices(self, machine_id: str) -> str:
        if machine_id == "local-cpu":
            return "-1"
        if machine_id == "local-gpu-all":
            return ",".join(str(i) for i in range(len(self._gpu_names)))
        return machine_id.removeprefix("local-gpu")

    def _dirs(self, name: str, user_id: int | None) -> tuple[int | None, Path, Path]:
        """The sandbox uid, the private work directory `workers/<name>` and the user's environment cache."""
        uid = self.sandbox.uid_for(user_id)
        workdir = private_dir(self.state_dir / "workers") / name  # 0700 even where an older version left 0755
        self.sandbox.prepare(workdir, uid)
        envs = private_dir(self.state_dir / "envs") / f"u{int(user_id or 0)}"  # one user's, never shared
        self.sandbox.prepare(envs, uid)
        return uid, workdir, envs

    def _spawn(
        self,
        module: str,
        machine_id: str,
        scheduled: Mapping[str, str],
        dirs: tuple[int | None, Path, Path],
        stdin: int,
    ) -> subprocess.Popen:
        uid, workdir, envs = dirs
        full_env = worker_env(
            os.environ, {**scheduled, "AIBRO_ENV_CACHE": str(envs)}, workdir, self._visible_devices(machine_id)
        )
        if self.sandbox.kind != "none":
            full_env["HOME"] = str(workdir)
        if self.net_dir is not None:
            full_env[BRIDGE_ENV] = jobnet.INSIDE
        log = open_private_log(workdir / "worker.log")
        argv = [self.python, "-I", "-m", module]
        proc = subprocess.Popen(
            self.sandbox.command(argv, workdir, [envs], uid, self.net_dir),
            env=full_env,
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(workdir),
        )
        log.close()
        return proc

    def launch(self, request: LaunchRequest) -> int:
        instance_id, machine_id, user_id, env = request.instance_id, request.machine_id, request.user_id, request.env
        spare = self._take_spare(machine_id, int(user_id or 0))
        proc = self._hand_over(spare, instance_id, env) if spare is not None else None
        if proc is None:
            proc = self._spawn(
                "aibro_backend.worker", machine_id, env, self._dirs(instance_id, user_id), subprocess.DEVNULL
            )
        self._procs[proc.pid] = proc
        self._workdirs[proc.pid] = self.state_dir / "workers" / instance_id
        if self.spare_on:  # the next spare starts a little later, not while this job's worker gears up
            self._prime_later = (int(user_id or 0), time.monotonic() + SPARE_DELAY_S)
        return proc.pid

    # -- the spare worker ------------------------------------------------------------------------------------
    def _hand_over(self, spare: Spare, instance_id: str, env: Mapping[str, str]) -> subprocess.Popen | None:
        """The spare becomes this instance's worker; None if it died meanwhile (a fresh worker starts instead)."""
        scheduled = {k: val for k, val in env.items() if k in FROM_SCHEDULER or k.startswith(FROM_SCHEDULER_PREFIXES)}
        try:
            spare.hand_over({**scheduled, "AIBRO_WORKER_DIR": str(spare.workdir)})
        except OSError:  # its pipe is broken: it exited between the check and the write
            self._procs[spare.proc.pid] = spare.proc  # reaped with the others
            self._workdirs[spare.proc.pid] = spare.workdir
            return None
        (self.state_dir / "workers" / instance_id).symlink_to(spare.workdir.name)  # its logs where they belong
        return spare.proc

    def prime(self, user_id: int) -> None:
        """Have a spare worker ready for `user_id`'s next local-cpu job (nothing when spares are off)."""
        if not self.spare_on:
            return
        if self._spare is not None:
            if self._spare.alive() and self._spare.user_id == user_id:
                return
            if self._spare.alive():
                self._spare.stop()  # it was another user's: a sandboxed spare runs as its user's uid
                self._procs[self._spare.proc.pid] = self._spare.proc  # reaped with the others, never waited for
                self._workdirs[self._spare.proc.pid] = self._spare.workdir
            elif not self._spare_crashes.note_exit(self._spare):
                self.spare_on, self._spare = False, None
                return
        name = f"spare-{os.urandom(4).hex()}"
        proc = self._spawn(SPARE_MODULE, SPARE_MACHINE, {}, self._dirs(name, user_id), subprocess.PIPE)
        self._spare = Spare(proc, self.state_dir / "workers" / name, user_id)

    def spare_of(self, user_id: int) -> str | None:
        """The machine id of the spare worker ready for `user_id`'s next job there, or None."""
        spare = self._spare
        return SPARE_MACHINE if spare is not None and spare.user_id == user_id and spare.alive() else None

    def _take_spare(self, machine_id: str, user_id: int) -> Spare | None:
        spare = self._spare
        if spare is None or machine_id != SPARE_MACHINE or spare.user_id != user_id or not spare.alive():
            return None
        self._spare = None
        return spare

    def close(self) -> None:
        """The backend stops: the unused spare goes with it."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.stop()
            spare.proc.wait(timeout=10)  # the backend is stopping: nothing else waits on the loop now

    def reap(self) -> None:
        """Collect every worker process that has exited, so none lingers as a zombie."""
        for pid, proc in list(self._procs.items()):
            if proc.poll() is not None:
                self._procs.pop(pid, None)
                remove_workdir(self._workdirs.pop(pid, None), self.logs)
        if self._spare is not None and not self._spare.alive():
            self.prime(self._spare.user_id)  # died unused (killed, out of memory): start another, unless it keeps dying
        if self._prime_later is not None and time.monotonic() >= self._prime_later[1]:
            user_id, self._prime_later = self._prime_later[0], None
            self.prime(user_id)

    def alive(self, instance: InstanceRecord) -> bool:
        """Whether its worker runs; one that is gone (the scheduler closes its instance now) leaves no folder."""
        pid = instance.pid
        proc = self._procs.get(pid) if pid else None
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)
        elif pid_alive(pid):
            return True
        self._workdirs.pop(pid or 0, None)
        remove_workdir(self.state_dir / "workers" / instance.id, self.logs)
        return False

    def terminate(self, instance: InstanceRecord) -> None:
        pid = instance.pid
        if pid and pid_alive(pid):
            for below in descendants(pid):  # a detached child of the job is no longer in the worker's group
                try:
                    os.kill(below, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        proc = self._procs.pop(pid, None) if pid else None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._workdirs.pop(pid, None)
        if not pid_alive(pid):
            remove_workdir(self.state_dir / "workers" / instance.id, self.logs)

    def sweep(self, live: Mapping[str, int | None]) -> int:
        """Remove the folders of instances whose worker is gone, and the week-old logs of closed ones; how many
        folders went. `live`: the local instances the store holds as live or closing, with their worker's pid.
        At start this cleans up after instances that closed while the backend was down (or that an older version
        left), and every sweep after it catches what an exit missed. The spare's folder, and that of any worker
        this backend started that has not been reaped yet, stay."""
        root = self.state_dir / "workers"
        if not root.is_dir():
            return 0
        keep = {path.name for pid, path in self._workdirs.items() if pid in self._procs and pid_alive(pid)}
        if self._spare is not None:
            keep.add(self._spare.workdir.name)
        keep |= {name for name, pid in live.items() if pid_alive(pid)}
        keep |= {os.readlink(root / name) for name in list(keep) if (root / name).is_symlink()}  # a spare's, linked
        removed = 0
        for entry in sorted(root.iterdir()):
            if entry.name not in keep:
                remove_workdir(entry, self.logs)
                removed += 1
        drop_old_logs(self.logs)
        return removed
