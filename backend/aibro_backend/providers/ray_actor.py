"""On a Ray node: the detached actor that holds an instance's reservation and runs the worker agent as its child.

Plain class: the bridge (providers/ray_bridge.py) wraps it with `ray.remote`, so importing it never needs Ray;
every node imports it from the code the bridge ships in the job's runtime_env (no aibro install on the nodes).
See ARCHITECTURE.md ("The Ray provider") for why an actor."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aibro_core.files import open_private_log, private_dir


def hold(root: Path, instance_id: str) -> int:
    """An instance's lock under `root/locks`, held (flock) by its actor's process for as long as it lives: the
    kernel lets go of it when that process dies, however (SIGKILL, the node's restart). The descriptor."""
    fd = os.open(private_dir(root / "locks") / instance_id, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def ended(root: Path, workdir: Path) -> None:
    """An instance's agent has exited: its folder goes, its worker.log kept as `root/worker-logs/<instance>.log`
    (local.remove_workdir, as the local provider does), and its lock with it."""
    from .local import WORKER_LOGS, remove_workdir

    remove_workdir(workdir, root / WORKER_LOGS)
    (root / "locks" / workdir.name).unlink(missing_ok=True)


def sweep(root: Path) -> int:
    """The folders of instances whose actor is gone without removing them (killed, its node restarted) go, with
    their logs kept, and the logs kept over a week; a folder whose lock an actor holds stays. How many went."""
    from .local import WORKER_LOGS, drop_old_logs

    removed = 0
    workers = root / "workers"
    for entry in sorted(workers.iterdir()) if workers.is_dir() else ():
        fd = os.open(private_dir(root / "locks") / entry.name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its actor lives
        try:
            ended(root, entry)
            removed += 1
        finally:
            os.close(fd)
    drop_old_logs(root / WORKER_LOGS)
    return removed


class InstanceActor:
    """Runs on a cluster node inside a Ray actor; holds the machine's resources while the agent it started runs.

    Plain class: the bridge wraps it with `ray.remote` (so importing this module never needs Ray).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        self._spec = spec
        self._proc: subprocess.Popen | None = None
        self._code: int | None = None
        self._error: str | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._lock: int | None = None  # the descriptor of its instance's lock (`hold`), held while it lives
        ctx = ray.get_runtime_context()
        self._info: dict[str, Any] = {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "actor_pid": os.getpid(),
        }
        # The agent's parent is this thread: it lives as long as the agent (PR_SET_PDEATHSIG follows the thread).
        threading.Thread(target=self._supervise, name="aibro-agent", daemon=True).start()
        self._started.wait()
        if self._error:
            raise RuntimeError(f"the worker agent could not start on {self._info['node_ip']}: {self._error}")

    def _command(self) -> tuple[list[str], dict[str, str], Path, str]:
        from .local import worker_env, worker_python
        from .sandbox import Sandbox
        from .shipping import agent_argv, code_roots

        spec = self._spec
        python = worker_python(os.environ.get("AIBRO_WORKER_PYTHON"))
        roots = code_roots()
        argv = list(spec.get("argv") or agent_argv(python, roots))
        box = Sandbox.choose(python, spec.get("sandbox") or "auto", roots, spec.get("sandbox_uid_base"))
        root = Path(spec.get("worker_root") or os.path.join(tempfile.gettempdir(), "aibro-ray"))
        if root.is_symlink() or (root.exists() and root.stat().st_uid != os.geteuid()):
            raise RuntimeError(f"{root} is not a folder of this node's Ray user: remove it, or set another worker_root")
        private_dir(root)  # 0700, and so are its folders, whatever the umask of Ray's workers
        uid = box.uid_for(spec.get("user_id"))
        self._lock = hold(root, spec["instance_id"])  # before its folder is there: a sweep never takes a live one
        sweep(root)
        workdir = private_dir(root / "workers") / spec["instance_id"]
        envs = private_dir(root / "envs") / f"u{int(spec.get('user_id') or 0)}"  # one user's, never shared
        box.prepare(workdir, uid)
        box.prepare(envs, uid)
        visible = ",".join(self._info["gpu_ids"]) or "-1"
        env = worker_env(os.environ, {**spec["env"], "AIBRO_ENV_CACHE": str(envs)}, workdir, visible)
        if box.kind != "none":
            env["HOME"] = str(workdir)
        cmd = box.command(argv, workdir, [envs], uid)
        if cmd and cmd[0] == "bwrap":
            cmd.insert(1, "--die-with-parent")
        return cmd, env, workdir, box.kind

    def _supervise(self) -> None:
        try:
            cmd, env, workdir, kind = self._command()
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)

            def die_with_parent() -> None:
                libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the agent dies with this actor, even by SIGKILL

            with open_private_log(workdir / "worker.log") as out:
                self._proc = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=str(workdir),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            self._info.update(pid=self._proc.pid, workdir=str(workdir), sandbox=kind)
        except Exception as exc:  # noqa: BLE001 - reported by the constructor, as the actor's creation error
            self._error = f"{type(exc).__name__}: {exc}"
            self._started.set()
            return
        self._started.set()
        self._code = self._proc.wait()
        with contextlib.suppress(OSError):  # before anyone hears of the end: the bridge kills this actor then
            ended(workdir.parent.parent, workdir)
        self._done.set()
        # Nobody killed this actor after the agent exited (the backend or its bridge is away): free the
        # reservation on its own after a while, so a finished instance never holds a GPU for good.
        time.sleep(float(self._spec.get("linger_s", 60.0)))
        with contextlib.suppress(Exception):
            import ray

            ray.kill(ray.get_runtime_context().current_actor)
        os._exit(0)

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def ping(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> int | None:
        """The agent's exit code once it exits; None while it still runs after `timeout_s`."""
        self._done.wait(timeout_s)
        return self._code if self._done.is_set() else None

    def stop(self, grace_s: float = 2.0) -> int | None:
        """SIGTERM the agent's process group, SIGKILL what is left after `grace_s` (pip installs too)."""
        proc = self._proc
        if proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)
            if self._done.wait(wait):
                break
        return self._code
