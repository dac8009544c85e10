"""How a local worker is confined: it runs the user's own code (Lambda layers, custom layers, travelling modules),
so it must not see the backend's state, credentials, other users' data, or other workers.

Chosen when the provider starts (`AIBRO_SANDBOX=auto|bwrap|none`, default auto):

* `bwrap` (Debian's `bubblewrap`): the worker runs in its own mount, PID, IPC and UTS namespaces whose file system
  holds only the system (`/usr`, `/etc`, read-only), the worker's Python installation and the aibro worker
  packages (read-only), its own private directory and its user's environment cache (writable), a fresh `/tmp`,
  `/proc` of its own PID namespace, and a minimal `/dev` (plus GPUs). The backend's home, database, blobs,
  artifacts, credentials and every other worker's directory simply do not exist in there. When the backend runs
  as root, the worker also drops to an unprivileged uid of its own per backend user (`AIBRO_SANDBOX_UID_BASE` +
  user id, no capabilities, no supplementary groups), so even a file that leaks into view is not readable.
  Chosen over running as a separate OS user alone because a plain uid switch still shows every world-readable
  file on the host, and over containers because it needs no daemon and no image, only one Debian package.
* `none`: no confinement beyond the allow-listed environment and the private directory (still the case for the
  embedded single-user backend where bubblewrap is not installed); the backend logs a warning at start.

The network is the worker's own (`--unshare-net`, see jobnet.py): it reaches the backend through a Unix socket and
the package index only while its environment is built; `AIBRO_JOB_NETWORK=host` shares the host's instead."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from aibro_core.files import private_dir

from . import jobnet
from .shipping import agent_argv

log = logging.getLogger("aibro.sandbox")

UID_BASE = 200_000
UNCONFINED = (
    "workers are NOT sandboxed: every job's code runs as this backend's own user and can read its state, its "
    "tokens and every other user's data; install bubblewrap (apt-get install bubblewrap) to confine them"
)


class SandboxRequired(RuntimeError):
    """A backend several users share would run their code unconfined."""


def require_confinement(kind: str, users: int, mode: str) -> str | None:
    """Whether a backend may serve: refuse (SandboxRequired) when several users would share unconfined workers
    and the operator did not say `--sandbox none`; the banner to show on every start when it runs unconfined."""
    if kind != "none":
        return None
    if users > 1 and mode != "none":
        raise SandboxRequired(
            f"this backend has {users} users and its workers cannot be sandboxed here (bubblewrap is missing or does "
            "not work), so one user's code could read another's data and tokens: install bubblewrap (apt-get "
            "install bubblewrap), or start it with --sandbox none to accept that"
        )
    return UNCONFINED


_PROBE = (
    "import json, os, sys\n"
    "sys.path[0:0] = sys.argv[1:]\n"
    "import aibro_backend, aibro_core\n"
    "paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}\n"
    "paths |= {os.path.dirname(os.path.realpath(os.path.dirname(sys.executable)))}\n"
    "pkgs = [os.path.dirname(m.__file__) for m in (aibro_backend, aibro_core)]\n"
    "project = ('pyproject.toml', 'setup.py', 'setup.cfg')\n"
    "sources = {os.path.dirname(p) for p in pkgs} | set(sys.argv[1:])\n"
    "sources |= {p for p in sys.path if any(os.path.exists(os.path.join(p, f)) for f in project)}\n"
    "paths |= {p for p in sys.path if p and p not in sources and os.path.isdir(p)}\n"
    "print(json.dumps({'paths': sorted(p for p in paths if p), 'packages': pkgs}))\n"
)


@dataclass
class Sandbox:
    """Wraps a worker's command line; `kind` says what confinement it gets ('bwrap' or 'none')."""

    kind: str
    python: str
    readonly: list[str] = field(default_factory=list)
    drop_uid: bool = False
    uid_base: int = UID_BASE
    code_roots: list[str] = field(default_factory=list)

    @classmethod
    def choose(
        cls, python: str, mode: str | None = None, code_roots: list[str] | None = None, uid_base: int | None = None
    ) -> Sandbox:
        """`code_roots`: where the agent's code is when `python` does not have it installed (see agent_argv);
        `mode` and `uid_base` as the backend's settings say (a Ray node's actor is given them: it has no settings)."""
        uid_base = UID_BASE if uid_base is None else uid_base
        if mode is None:  # the backend's own workers: its settings (imported here: a Ray node has no pydantic-settings)
            from ..settings import BackendSettings

            settings = BackendSettings.from_env()
            mode, uid_base = settings.sandbox, settings.sandbox_uid_base
        mode = mode.lower()
        if mode not in ("auto", "bwrap", "none"):
            raise ValueError(f"AIBRO_SANDBOX={mode!r}: use auto, bwrap or none")
        if mode == "none":
            return cls("none", python)
        if shutil.which("bwrap") is None:
            if mode == "bwrap":
                raise ValueError("AIBRO_SANDBOX=bwrap but bwrap is not installed: apt-get install bubblewrap")
            return cls("none", python)
        try:
            readonly = _worker_paths(python, code_roots or [])
            box = cls("bwrap", python, readonly, drop_uid=os.geteuid() == 0, uid_base=uid_base)
            box.code_roots = list(code_roots or [])
            box._selftest()
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            if mode == "bwrap":
                raise ValueError(f"AIBRO_SANDBOX=bwrap but the sandbox does not work here: {exc}") from None
            log.warning("bubblewrap does not work on this host (%s)", exc)
            return cls("none", python)
        log.info("workers run sandboxed (bubblewrap%s)", ", unprivileged uid" if box.drop_uid else "")
        return box

    def uid_for(self, user_id: int | None) -> int | None:
        return self.uid_base + int(user_id or 0) if self.drop_uid else None

    def prepare(self, path: Path, uid: int | None) -> None:
        """A private directory the worker (and only it) can write: 0700 from its creation, then given to its uid."""
        private_dir(path)
        if uid is not None:
            os.chown(path, uid, uid)

    def command(
        self, argv: list[str], workdir: Path, writable: list[Path], uid: int | None, net_dir: Path | None = None
    ) -> list[str]:
        """The worker's command line in the sandbox; with `net_dir` (providers/jobnet.py) it gets a network of its
        own whose only ways out are the sockets in that folder."""
        if self.kind == "none":
            return argv
        cmd = ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt"):
            if os.path.islink(top):
                cmd += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                cmd += ["--ro-bind", top, top]
        if os.path.isdir("/sys"):
            cmd += ["--ro-bind", "/sys", "/sys"]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        cmd += ["--perms", "1777", "--tmpfs", "/dev/shm"]
        for dev in sorted(Path("/dev").glob("nvidia*")):
            cmd += ["--dev-bind", str(dev), str(dev)]
        mounts = [(p, "--ro-bind") for p in self.readonly] + [(str(p), "--bind") for p in [workdir, *writable]]
        for parent in _parents([m for m, _ in mounts]):
            cmd += ["--perms", "0755", "--dir", parent]
        for path, how in mounts:
            cmd += [how, path, path]
        if net_dir is not None:
            cmd += ["--unshare-net", "--perms", "0755", "--dir", str(Path(jobnet.INSIDE).parent)]
            cmd += ["--ro-bind", str(net_dir), jobnet.INSIDE]
        # No --die-with-parent: a worker outlives a backend that crashed, and the next start adopts it. Its own
        # PID namespace ends with it (terminate() kills it), and the agent ends its jobs' processes (jobprocs.py).
        cmd += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--chdir", str(workdir)]
        if uid is not None:
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
            cmd += ["--bounding-set=-all", "--no-new-privs", "--"]
        return cmd + argv

    def _selftest(self) -> None:
        """Run the worker's interpreter once inside the sandbox: fail here, not on the first job."""
        probe = Path(os.environ.get("TMPDIR") or "/tmp") / f"aibro-sandbox-probe-{os.getpid()}"
        uid = self.uid_for(0)
        self.prepare(probe, uid)
        try:
            argv = agent_argv(self.python, self.code_roots, "aibro_backend.worker.usercode")
            done = subprocess.run(
                self.command(argv, probe, [], uid),
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(probe)},
            )
            if done.returncode != 0:
                raise ValueError((done.stderr or done.stdout).strip()[-500:] or f"exit {done.returncode}")
        finally:
            shutil.rmtree(probe, ignore_errors=True)


def _worker_paths(python: str, code_roots: list[str]) -> list[str]:
    """What the worker's interpreter needs to see: its installation, the folders its .pth files add (a shared
    site-packages, say) and the aibro worker packages, nothing more (an editable install's source folder, which holds
    its project file, is bound package by package, never the folder around it)."""
    done = subprocess.run([python, "-I", "-c", _PROBE, *code_roots], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ValueError(f"cannot inspect {python}: {done.stderr.strip()[-300:]}")
    found = json.loads(done.stdout)
    paths = [p for p in found["paths"] if os.path.isdir(p) and not p.startswith(("/usr/", "/etc/"))]
    outside = [p for p in found["packages"] if not any(p.startswith(q.rstrip("/") + "/") for q in paths)]
    keep: list[str] = []
    for p in sorted(set(paths + outside), key=len):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in keep):
            keep.append(p)
    return keep


def _parents(paths: list[str]) -> list[str]:
    """Every folder above the mount points, created traversable (0755) so an unprivileged worker can reach them
    even when the host's folder is private (a Python under /root)."""
    out: list[str] = []
    for path in paths:
        parts = Path(path).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            if parent not in out and parent not in ("/usr", "/etc", "/tmp", "/proc", "/dev", "/sys"):
                out.append(parent)
    return out
