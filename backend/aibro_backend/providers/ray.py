"""The Ray provider: each instance is the worker agent, run by a detached Ray actor on a node of an existing cluster.

Teams that already run a Ray cluster (GPU boxes joined with `ray start`, KubeRay, Ray's cloud launcher) get its
nodes as machines; nothing here starts or scales the cluster itself.

**An instance is a detached actor that holds the reservation** (not a Job Submission API job, not a bare
placement group):

* The reservation *is* the actor. A named (`aibro-<instance id>`), detached actor created with the machine's
  `num_cpus` / `num_gpus` (and an accelerator or node-pool resource) holds them on one node exactly as long as it
  lives. It runs the agent (`python -I -m aibro_backend.worker`) as a child process on that node, with only the
  allow-listed environment and a private directory (the local provider's `worker_env` and `Sandbox`, chosen on the
  node), and with `CUDA_VISIBLE_DEVICES` set to the GPUs Ray gave it. While the agent cools it keeps polling the
  backend for its next assignment as on every provider, so the actor, and with it the reservation, stays: the
  next job reuses the warm instance with no gear-up. When the agent exits (the backend told it to) the actor is
  killed and Ray frees the resources.
* The Job Submission API also reserves resources (for its supervisor actor), but it needs the dashboard's HTTP job
  server (often off or firewalled) and a second address, says only PENDING while waiting (not for what), and ties
  the agent's lifetime to a job whose logs travel through Ray. An actor needs only the GCS, and its method calls
  are the health check (below).
* A placement group reserves the same resources but still needs an actor or task inside it to run the agent: for
  a machine that fits on one node it is one more object to create and clean up for nothing.
* Faults come with actors: a call on an actor whose process or node died fails (`ActorUnavailableError` within
  about 3 s, `ActorDiedError` once Ray's health check marks the node dead, ~15 s by default). An instance
  unreachable for `unreachable_grace_s` (while the cluster itself still answers) or on a dead node is lost:
  `alive()` turns false and the scheduler resumes its job from the last checkpoint. An actor that cannot be placed
  now stays pending (`pending()` says "waiting for 1 GPU on the Ray cluster (ADDRESS)") instead of failing.

Bytes never travel through Ray: the agent speaks HTTP to the backend (`AIBRO_WORKER_URL`, overridable with
`backend_url` for nodes on other hosts) for its assignment, model, data, events, checkpoints and artifacts, as on
every provider. Ray carries only the actor's creation arguments (the agent's environment) and small status calls.

**The Ray driver runs in a bridge process, not in the backend.** A driver whose cluster disappears blocks in every
call (`ray.nodes()` hangs) and, 60 s later, Ray terminates the whole process ("Failed to connect to GCS within 60
seconds ... The program will terminate"): inside the backend that would take the API and every user's jobs down
with the cluster. `ray.init` and many calls also block for seconds, while the scheduler's tick runs on the IOLoop.
So `RayProvider` starts `python -c "...bridge_main()"` as a child, sends it commands (JSON lines on its stdin) and
reads its reports (JSON lines on a pipe of their own): `offers`, `alive`, `pending`, `info` answer at once from the
last picture the bridge sent (nodes every `refresh_s`, instances as they change). Ray is imported only in the bridge
and on the nodes, never in the backend or the notebook. A bridge whose calls hang for `call_timeout_s`, or that
finds the GCS port closed, reports the cluster lost and exits; the provider then fails its live instances with a
message naming the cluster (`cluster_error()`) and starts a new bridge every `reconnect_s` until the cluster is
back. Detached actors outlive a bridge or backend restart, and a new bridge adopts them by name.

Every node needs `aibro-backend` installed in the Python that runs Ray (`pip install "./backend"` next to
`ray[default]`): the actor's class lives in this module, and the agent runs from it. Price is 0: the team's
cluster is already paid for.

Trust: the agent runs the user's own code on a cluster node. The sandbox (bubblewrap when present) hides the node's
files and other workers' directories, but the network is shared, and a Ray cluster without token auth
(`RAY_AUTH_MODE=token`) accepts work from anything that reaches it: give aibro a cluster (or a node pool selected
with `node_resource`) that holds nothing else users must not touch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("aibro.ray")

NAMESPACE = "aibro"
ACTOR_PREFIX = "aibro-"
LIVE = frozenset({"starting", "pending", "running", "adopting", "terminating"})
WAIT_SLICE_S = 20.0  # one actor.wait() call: bounded, so a call lost to a network blip never pins a thread
PING_EVERY_S = 1.0
PLACEMENT_EVERY_S = 0.5
FRACTION = 0.001  # how much of a marker resource (node pool, accelerator type) one instance takes


class RayUnavailable(RuntimeError):
    """Ray is not installed where the provider needs it."""


class RayClusterError(RuntimeError):
    """The Ray cluster is gone or unreachable; the message names its address."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


# -- marketplace: machines from the nodes' resources (pure functions, no Ray needed) ------------------------------
def _powers(top: int) -> list[int]:
    out, n = [], 1
    while n <= top:
        out.append(n)
        n *= 2
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def fits(need: Mapping[str, float], have: Mapping[str, float] | None) -> int:
    """How many instances needing `need` fit into `have` (a node's total or available resources)."""
    if not have:
        return 0
    counts = [math.floor(float(have.get(k, 0.0)) / amount + 1e-9) for k, amount in need.items() if amount > 0]
    return max(0, min(counts)) if counts else 0


def gpu_types(resources: Mapping[str, float]) -> list[str]:
    """GPU names Ray reports for a node (`accelerator_type:A100` resources)."""
    return sorted(k.split(":", 1)[1] for k, val in resources.items() if k.startswith("accelerator_type:") and val > 0)


def _gpu_phrase(count: int, gpu_type: str | None) -> str:
    name = f"{gpu_type} " if gpu_type and gpu_type != "GPU" and "/" not in gpu_type else ""
    return f"{count} {name}GPU{'s' if count != 1 else ''}"


def need_text(offer: Mapping[str, Any]) -> str:
    """What one instance of `offer` waits for, in words: '1 GPU', '2 A100 GPUs', '4 CPUs'."""
    if offer.get("gpu_count"):
        return _gpu_phrase(int(offer["gpu_count"]), offer.get("gpu_type"))
    n = int(offer.get("vcpus") or 0)
    return f"{n} CPU{'s' if n != 1 else ''}"


def build_machines(
    nodes: Sequence[Mapping[str, Any]], node_resource: str | None = None
) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """(offer, Ray resources one instance reserves) for every machine some live node can hold.

    `nodes`: dicts with `alive`, `total` and `available` resources (None: unknown). `ray-cpuN` reserves N CPUs,
    `ray-gpuN` N GPUs and N CPUs, for N in powers of two up to the largest node; when nodes report more than one
    GPU type, `ray-gpuN-<type>` pins a type. With `node_resource`, only nodes that have that custom resource count,
    and every instance takes a sliver of it (a node pool for aibro inside a bigger cluster).
    """
    hosts = [n for n in nodes if n.get("alive", True) and (not node_resource or n["total"].get(node_resource, 0) > 0)]
    if not hosts:
        return []
    marker = {node_resource: FRACTION} if node_resource else {}
    specs: list[tuple[str, dict[str, float], int, str | None]] = []
    max_cpu = max(int(n["total"].get("CPU", 0)) for n in hosts)
    specs += [(f"ray-cpu{c}", {"CPU": float(c), **marker}, 0, None) for c in _powers(max_cpu)]
    gpu_hosts = [n for n in hosts if n["total"].get("GPU", 0) >= 1]
    max_gpu = max((int(n["total"]["GPU"]) for n in gpu_hosts), default=0)
    specs += [(f"ray-gpu{g}", {"GPU": float(g), "CPU": float(g), **marker}, g, None) for g in _powers(max_gpu)]
    types = sorted({t for n in gpu_hosts for t in gpu_types(n["total"])})
    if len(types) > 1:
        for t in types:
            top = max(int(n["total"]["GPU"]) for n in gpu_hosts if t in gpu_types(n["total"]))
            pin = {f"accelerator_type:{t}": FRACTION}
            specs += [
                (f"ray-gpu{g}-{_slug(t)}", {"GPU": float(g), "CPU": float(g), **marker, **pin}, g, t)
                for g in _powers(top)
            ]
    out = []
    for machine_id, need, gpus, pinned in specs:
        holders = [n for n in hosts if fits(need, n["total"]) >= 1]
        if not holders:
            continue  # no node can hold it: not offered
        capacity = sum(fits(need, n["total"]) for n in holders)
        available = sum(fits(need, n["available"] if n.get("available") is not None else n["total"]) for n in holders)
        gpu_type = None
        if gpus:
            names = sorted({t for n in holders for t in gpu_types(n["total"])})
            gpu_type = pinned or ("/".join(names) if names else "GPU")
        offer = {
            "machine_id": machine_id,
            "provider": "ray",
            "gpu_type": gpu_type,
            "gpu_count": gpus,
            "vcpus": int(need["CPU"]),
            "memory_gib": round(min(float(n["total"].get("memory", 0)) for n in holders) / 2**30, 1),
            "price_per_hour": 0.0,
            "on_demand_price_per_hour": 0.0,
            "price_source": "cluster",  # the team's cluster is already paid for
            "spot": False,
            "capacity": capacity,
            "available": available,
            "nodes": len(holders),
            "availability": "available" if available else "busy",
        }
        out.append((offer, need))
    return out


# -- on a node: the actor that holds the reservation and runs the agent --------------------------------------------
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

        spec = self._spec
        python = worker_python(os.environ.get("AIBRO_WORKER_PYTHON"))
        argv = list(spec.get("argv") or [python, "-I", "-m", "aibro_backend.worker"])
        box = Sandbox.choose(python, spec.get("sandbox") or "auto")
        root = Path(spec.get("worker_root") or os.path.join(tempfile.gettempdir(), "aibro-ray"))
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        uid = box.uid_for(spec.get("user_id"))
        (root / "workers").mkdir(exist_ok=True, mode=0o700)
        (root / "envs").mkdir(exist_ok=True, mode=0o700)
        workdir = root / "workers" / spec["instance_id"]
        envs = root / "envs" / f"u{int(spec.get('user_id') or 0)}"  # one user's cached environments, never shared
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

            with open(workdir / "worker.log", "ab") as out:
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


# -- the bridge: the Ray driver, in a process of its own -----------------------------------------------------------
def gcs_refusal(address: str) -> str | None:
    """Why the cluster's address refuses a TCP connection now (None: it accepts, or the address has no port)."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=3):
            return None
    except OSError as exc:
        return f"{hostport} refuses connections ({exc.strerror or exc})"


class _Tracked:
    """The bridge's picture of one instance's actor and the calls in flight on it."""

    def __init__(self, instance_id: str, actor: Any, state: str, need: dict[str, float] | None = None) -> None:
        self.id = instance_id
        self.actor = actor
        self.state = state
        self.need = need or {}
        self.info: dict[str, Any] = {}
        self.placed_node = ""
        self.message = ""
        self.exit_code: int | None = None
        self.info_ref: Any = None
        self.wait_ref: Any = None
        self.ping_ref: Any = None
        self.stop_ref: Any = None
        self.ping_at = 0.0
        self.kill_at = 0.0
        self.unreachable_since: float | None = None

    def report(self) -> dict[str, Any]:
        return {
            "type": "instance",
            "id": self.id,
            "state": self.state,
            "message": self.message,
            "placed_node": self.placed_node,
            "exit_code": self.exit_code,
            **{k: self.info.get(k) for k in ("node_id", "node_ip", "hostname", "pid", "gpu_ids", "workdir", "sandbox")},
        }


class _Bridge:
    def __init__(self, cfg: dict[str, Any], out: Any) -> None:
        self.cfg = cfg
        self.address: str = cfg["address"]
        self.out = out
        self.out_lock = threading.Lock()
        self.commands: queue.Queue = queue.Queue()
        self.tracked: dict[str, _Tracked] = {}
        self.alive_nodes: dict[str, dict[str, Any]] = {}
        self.busy: tuple[float, str, float] | None = None  # (since, what, limit)
        self.ray: Any = None
        self.actor_cls: Any = None

    def emit(self, msg: dict[str, Any]) -> None:
        with self.out_lock:
            self.out.write(json.dumps(msg) + "\n")
            self.out.flush()

    def lost(self, message: str) -> None:
        """The cluster is gone: say so and leave at once (a Ray driver without its GCS only hangs, then dies)."""
        with contextlib.suppress(Exception):
            self.emit({"type": "cluster_lost", "message": message})
        os._exit(3)

    @contextlib.contextmanager
    def call(self, what: str, limit: float | None = None) -> Any:
        self.busy = (time.monotonic(), what, limit or float(self.cfg["call_timeout_s"]))
        try:
            yield
        finally:
            self.busy = None

    def _watchdog(self) -> None:
        while True:
            time.sleep(0.25)
            busy = self.busy
            if busy and time.monotonic() - busy[0] > busy[2]:
                self.lost(f"the Ray cluster at {self.address} does not answer ({busy[1]} took more than {busy[2]:g} s)")

    def _read_commands(self) -> None:
        for line in sys.stdin:
            with contextlib.suppress(ValueError):
                self.commands.put(json.loads(line))
        os._exit(0)  # the backend is gone; the detached actors stay, a new backend adopts them

    def run(self) -> None:
        threading.Thread(target=self._watchdog, daemon=True).start()
        refused = gcs_refusal(self.address)
        if refused:
            self.lost(f"the Ray cluster at {self.address} is unreachable: {refused}")
        try:
            import ray
        except ImportError as exc:
            self.emit({"type": "fatal", "message": f"Ray is not installed for the backend ({exc}): {INSTALL_HINT}"})
            os._exit(4)
        self.ray = ray
        with self.call("connecting", float(self.cfg["connect_timeout_s"])):
            try:
                ray.init(
                    address=self.address,
                    namespace=self.cfg["namespace"],
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
            except Exception as exc:  # noqa: BLE001 - the message goes to the backend
                self.lost(f"cannot connect to the Ray cluster at {self.address}: {type(exc).__name__}: {exc}")
        self.actor_cls = ray.remote(InstanceActor)
        self.emit({"type": "connected", "ray_version": ray.__version__})
        threading.Thread(target=self._read_commands, daemon=True).start()
        next_refresh = next_placement = 0.0
        while True:
            now = time.monotonic()
            if now >= next_refresh:
                self.refresh()
                next_refresh = now + float(self.cfg["refresh_s"])
            if now >= next_placement:
                self._check_placement()
                next_placement = now + PLACEMENT_EVERY_S
            try:
                cmd = self.commands.get(timeout=0.2)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self.handle(cmd)
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    cmd = None
            self.check_instances()

    # -- the cluster's nodes ---------------------------------------------------------------------------------------
    def refresh(self) -> None:
        refused = gcs_refusal(self.address)
        if refused:
            time.sleep(0.5)  # twice in a row: a GCS restarting (fault tolerance) may refuse for a moment
            refused = gcs_refusal(self.address)
            if refused:
                self.lost(f"the Ray cluster at {self.address} is gone: {refused}")
        ray = self.ray
        with self.call("ray.nodes()"):
            raw = ray.nodes()
        available: dict[str, dict[str, float]] | None = None
        cluster_available: dict[str, float] | None = None
        with self.call("reading available resources"), contextlib.suppress(Exception):
            from ray._private import state  # a DeveloperAPI, not served through Ray Client (ray://)

            available = state.available_resources_per_node()
        if available is None:
            with self.call("reading available resources"), contextlib.suppress(Exception):
                cluster_available = {k: float(val) for k, val in ray.available_resources().items()}
        nodes = []
        for n in raw:
            if not n.get("Alive"):
                continue
            node_id = n["NodeID"]
            nodes.append(
                {
                    "node_id": node_id,
                    "ip": n.get("NodeManagerAddress", ""),
                    "hostname": n.get("NodeManagerHostname", ""),
                    "port": n.get("NodeManagerPort"),
                    "alive": True,
                    "total": {k: float(val) for k, val in (n.get("Resources") or {}).items()},
                    "available": None if available is None else available.get(node_id, {}),
                }
            )
        self.alive_nodes = {n["node_id"]: n for n in nodes}
        self.emit({"type": "nodes", "nodes": nodes, "cluster_available": cluster_available})

    def _check_placement(self) -> None:
        """Which pending actors Ray has placed on a node (starting) and which still wait for resources."""
        pending = [t for t in self.tracked.values() if t.state in ("pending", "adopting") and not t.placed_node]
        if not pending:
            return
        with self.call("reading the actor table"), contextlib.suppress(Exception):
            from ray._private import state

            for t in pending:
                entry = state.actors(actor_id=t.actor._actor_id.hex()) or {}
                node = (entry.get("Address") or {}).get("NodeID") or ""
                if entry.get("Pid") and node.strip("f0"):  # a worker process holds its lease: placed
                    t.placed_node = node
                    if t.state == "pending":
                        t.state = "starting"
                    self.emit(t.report())

    # -- commands from the backend -----------------------------------------------------------------------------------
    def handle(self, cmd: dict[str, Any]) -> None:
        op, instance_id = cmd.get("op"), str(cmd.get("id", ""))
        try:
            if op == "launch":
                self.launch(instance_id, cmd)
            elif op == "terminate":
                self.terminate(instance_id)
            elif op == "adopt":
                self.adopt(instance_id)
            elif op == "forget":
                self.tracked.pop(instance_id, None)
        except Exception as exc:  # noqa: BLE001 - one bad command never stops the bridge
            log.exception("%s %s failed", op, instance_id)
            self.emit({"type": "instance", "id": instance_id, "state": "lost", "message": f"{op} failed: {exc}"})

    def launch(self, instance_id: str, cmd: dict[str, Any]) -> None:
        need = dict(cmd["need"])
        cpus, gpus = need.pop("CPU", 0.0), need.pop("GPU", 0.0)
        with self.call("creating the actor"):
            actor = self.actor_cls.options(
                name=ACTOR_PREFIX + instance_id,
                namespace=self.cfg["namespace"],
                lifetime="detached",
                num_cpus=cpus,
                num_gpus=gpus,
                resources=need or None,
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=8,
                scheduling_strategy="SPREAD",  # several instances at once land on different nodes
            ).remote(cmd["spec"])
        t = _Tracked(instance_id, actor, "pending", cmd["need"])
        self.tracked[instance_id] = t
        self._watch(t)
        self.emit(t.report())

    def _watch(self, t: _Tracked) -> None:
        t.info_ref = t.actor.info.remote()
        t.wait_ref = t.actor.wait.remote(WAIT_SLICE_S)

    def adopt(self, instance_id: str) -> None:
        if instance_id in self.tracked:
            self.emit(self.tracked[instance_id].report())
            return
        try:
            with self.call("looking up the actor"):
                actor = self.ray.get_actor(ACTOR_PREFIX + instance_id, namespace=self.cfg["namespace"])
        except ValueError:
            message = f"no Ray actor {ACTOR_PREFIX}{instance_id} on the cluster at {self.address}: it is gone"
            self.emit({"type": "instance", "id": instance_id, "state": "lost", "message": message})
            return
        t = _Tracked(instance_id, actor, "adopting")
        self.tracked[instance_id] = t
        self._watch(t)
        self.emit(t.report())

    def terminate(self, instance_id: str) -> None:
        t = self.tracked.get(instance_id)
        if t is None:
            with contextlib.suppress(ValueError), self.call("looking up the actor"):
                actor = self.ray.get_actor(ACTOR_PREFIX + instance_id, namespace=self.cfg["namespace"])
                self.ray.kill(actor, no_restart=True)
            self.emit({"type": "instance", "id": instance_id, "state": "terminated", "message": "terminated"})
            return
        if t.state not in LIVE or t.state == "terminating":
            self.emit(t.report())
            return
        if not t.info:  # not started yet (pending, or its creation in flight): nothing to stop first
            self._kill(t, "terminated")
            return
        t.state, t.message = "terminating", "stopping the worker"
        t.stop_ref = t.actor.stop.remote(2.0)
        t.kill_at = time.monotonic() + 6.0
        self.emit(t.report())

    def _kill(self, t: _Tracked, state: str, message: str | None = None) -> None:
        with contextlib.suppress(Exception), self.call("killing the actor"):
            self.ray.kill(t.actor, no_restart=True)  # frees the reservation now
        t.state, t.message = state, message or state
        t.info_ref = t.wait_ref = t.ping_ref = t.stop_ref = None
        self.emit(t.report())

    # -- the instances' calls -----------------------------------------------------------------------------------------
    def check_instances(self) -> None:
        ray = self.ray
        owners: dict[Any, tuple[_Tracked, str]] = {}
        for t in self.tracked.values():
            for kind in ("info_ref", "wait_ref", "ping_ref", "stop_ref"):
                ref = getattr(t, kind)
                if ref is not None:
                    owners[ref] = (t, kind)
        if owners:
            with self.call("ray.wait"):
                ready, _ = ray.wait(list(owners), num_returns=len(owners), timeout=0)
            for ref in ready:
                t, kind = owners[ref]
                setattr(t, kind, None)
                self._answer(t, kind, ref)
        now = time.monotonic()
        for t in list(self.tracked.values()):
            if t.state not in LIVE:
                continue
            node_id = t.info.get("node_id") or t.placed_node
            if node_id and node_id not in self.alive_nodes and self.alive_nodes:
                self._kill(t, "lost", f"the Ray node {self._node_name(t)} holding it died")
            elif t.unreachable_since is not None and now - t.unreachable_since > float(self.cfg["unreachable_grace_s"]):
                grace = float(self.cfg["unreachable_grace_s"])
                self._kill(t, "lost", f"the Ray node {self._node_name(t)} holding it has not answered for {grace:g} s")
            elif t.unreachable_since is not None and t.ping_ref is None and now >= t.ping_at:
                t.ping_ref = t.actor.ping.remote()
                t.ping_at = now + PING_EVERY_S
            elif t.state == "terminating" and now >= t.kill_at:
                self._kill(t, "terminated")

    def _death_message(self, t: _Tracked, exc: BaseException) -> str:
        text = str(exc).strip()
        ours = re.search(r"the worker agent could not start[^\n]*", text)
        if ours:  # the constructor's own words, from inside Ray's wrapping of a creation-task error
            return ours.group(0)
        first = text.splitlines()[0] if text else type(exc).__name__
        where = f"on {self._node_name(t)} " if (t.info or t.placed_node) else ""
        return f"the Ray actor {where}died: {first}"

    def _raylet_refuses(self, t: _Tracked) -> bool:
        node = self.alive_nodes.get(t.info.get("node_id") or t.placed_node) or {}
        if not node.get("ip") or not node.get("port"):
            return False
        try:
            with self.call("probing the node"), socket.create_connection((node["ip"], int(node["port"])), timeout=1):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # no answer at all (the host is down or cut off): the grace period decides

    def _node_name(self, t: _Tracked) -> str:
        node_id = t.info.get("node_id") or t.placed_node
        ip = t.info.get("node_ip") or (self.alive_nodes.get(node_id) or {}).get("ip") or "?"
        return f"{ip} (node {node_id[:12]})" if node_id else ip

    def _answer(self, t: _Tracked, kind: str, ref: Any) -> None:
        ray = self.ray
        # Ray before 2.2x had no ActorUnavailableError: there a lost connection is an ActorDiedError at once.
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())

        try:
            with self.call("ray.get"):
                value = ray.get(ref, timeout=5)
        except unavailable:
            if t.state in LIVE and t.state != "terminating":
                t.unreachable_since = t.unreachable_since or time.monotonic()
                if self._raylet_refuses(t):  # the node's Ray is down while its host answers: no need to wait
                    self._kill(t, "lost", f"the Ray node {self._node_name(t)} holding it is gone (its raylet is down)")
            return
        except Exception as exc:  # noqa: BLE001 - ActorDiedError or anything else: the actor is gone
            if t.state == "terminating":
                self._kill(t, "terminated")
            elif t.state in LIVE:
                self._kill(t, "lost", self._death_message(t, exc))
            return
        t.unreachable_since = None
        if kind == "info_ref":
            t.info = dict(value)
            if t.state in ("pending", "starting", "adopting"):
                t.state, t.message = "running", "running"
            self.emit(t.report())
        elif kind == "wait_ref":
            if value is None:
                if t.state in LIVE:
                    t.wait_ref = t.actor.wait.remote(WAIT_SLICE_S)
                return
            t.exit_code = int(value)
            if t.state == "terminating":
                self._kill(t, "terminated")
            else:
                self._kill(t, "exited", f"the worker exited with code {value}")
        elif kind == "ping_ref":
            if t.state in LIVE and t.wait_ref is None:
                t.wait_ref = t.actor.wait.remote(WAIT_SLICE_S)
        elif kind == "stop_ref":
            self._kill(t, "terminated")


INSTALL_HINT = 'pip install "aibro-jupyter[ray]" (or "ray[default]") in the backend\'s environment'


def bridge_main() -> None:
    """Entry point of the bridge process: `python -c "from aibro_backend.providers.ray import bridge_main; ..."`."""
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ray-bridge %(levelname)s %(message)s")
    out = os.fdopen(int(cfg["fd"]), "w", buffering=1)
    _Bridge(cfg, out).run()


# -- the backend side --------------------------------------------------------------------------------------------
class RayProvider:
    """An existing Ray cluster as machines: see the module docstring for the how and why.

    `address`: what `ray.init` takes (`HOST:PORT` of the GCS from a host of the cluster, `ray://HOST:10001` through
    Ray Client from elsewhere). `worker_command`: the agent's argv on the node (default: the node's Ray Python,
    `python -I -m aibro_backend.worker`). `backend_url`: the backend's URL as nodes reach it (default: the one the
    scheduler gives). `node_resource`: use only nodes with this custom resource. `worker_root`: where workers'
    private directories live on a node (default `<tmp>/aibro-ray`). `sandbox`: auto | bwrap | none, chosen on
    the node as for local workers.
    """

    name = "ray"

    def __init__(
        self,
        address: str,
        state_dir: Path,
        *,
        worker_command: Sequence[str] | None = None,
        backend_url: str | None = None,
        namespace: str = NAMESPACE,
        node_resource: str | None = None,
        worker_root: str | None = None,
        sandbox: str = "auto",
        refresh_s: float = 2.0,
        unreachable_grace_s: float = 5.0,
        call_timeout_s: float = 10.0,
        connect_timeout_s: float = 60.0,
        reconnect_s: float = 5.0,
        linger_s: float = 60.0,
        python: str | None = None,
    ) -> None:
        if not address or not address.strip():
            raise ValueError(
                "the Ray provider needs the cluster's address (--ray-address HOST:PORT or ray://HOST:PORT)"
            )
        self.python = python or sys.executable
        if self.python == sys.executable and importlib.util.find_spec("ray") is None:
            raise RayUnavailable(f"the Ray provider needs Ray: {INSTALL_HINT}")
        self.address = address.strip()
        self.state_dir = Path(state_dir)
        self.worker_command = list(worker_command) if worker_command else None
        self.backend_url = backend_url
        self.namespace = namespace
        self.node_resource = node_resource
        self.worker_root = worker_root
        self.sandbox = sandbox
        self.refresh_s = refresh_s
        self.unreachable_grace_s = unreachable_grace_s
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_s = reconnect_s
        self.linger_s = linger_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._nodes: list[dict[str, Any]] = []
        self._cluster_available: dict[str, float] | None = None  # when free resources per node are unknown
        self._nodes_at = 0.0
        self._machines: dict[str, tuple[dict[str, Any], dict[str, float]]] = {}
        self._instances: dict[str, dict[str, Any]] = {}
        self._connected = False
        self._cluster_error: str | None = None
        self._fatal: str | None = None
        self._ray_version = ""
        self._proc: subprocess.Popen | None = None
        self._gen = 0
        self._restart_at = 0.0
        self._closed = False
        self._outq: queue.Queue = queue.Queue()
        self._ensure_bridge()

    # -- the bridge process ----------------------------------------------------------------------------------------
    def _ensure_bridge(self) -> None:
        with self._lock:
            if self._closed or self._fatal:
                return
            if self._proc is not None and self._proc.poll() is None:
                return
            if time.monotonic() < self._restart_at:
                return
            self._start_bridge()

    def _start_bridge(self) -> None:
        (self.state_dir / "ray").mkdir(parents=True, exist_ok=True, mode=0o700)
        rfd, wfd = os.pipe()
        cfg = {
            "address": self.address,
            "namespace": self.namespace,
            "fd": wfd,
            "refresh_s": self.refresh_s,
            "unreachable_grace_s": self.unreachable_grace_s,
            "call_timeout_s": self.call_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
        }
        code = "from aibro_backend.providers.ray import bridge_main; bridge_main()"
        with open(self.state_dir / "ray" / "bridge.log", "ab") as logf:
            try:
                proc = subprocess.Popen(
                    [self.python, "-c", code, json.dumps(cfg)],
                    stdin=subprocess.PIPE,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    pass_fds=(wfd,),
                    start_new_session=True,
                    text=True,
                )
            finally:
                os.close(wfd)
        self._gen += 1
        self._proc = proc
        self._connected = False
        self._outq = queue.Queue()
        gen = self._gen
        threading.Thread(target=self._read, args=(rfd, proc, gen), daemon=True, name="ray-bridge-read").start()
        threading.Thread(target=self._write, args=(proc, self._outq), daemon=True, name="ray-bridge-write").start()

    def _send(self, msg: dict[str, Any]) -> None:
        self._outq.put(json.dumps(msg))

    @staticmethod
    def _write(proc: subprocess.Popen, q: queue.Queue) -> None:
        """Commands to the bridge, off the caller's thread (a busy bridge never blocks the IOLoop)."""
        while True:
            line = q.get()
            if line is None:
                return
            try:
                assert proc.stdin is not None
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                return

    def _read(self, rfd: int, proc: subprocess.Popen, gen: int) -> None:
        with os.fdopen(rfd, "r") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._lock:
                    if gen == self._gen:
                        self._on_message(msg, gen)
                    self._changed.notify_all()
        proc.wait()
        with self._lock:
            if gen != self._gen:
                return
            self._connected = False
            self._restart_at = time.monotonic() + self.reconnect_s
            if not self._cluster_error and not self._closed and not self._fatal:
                self._cluster_lost(f"the Ray bridge for the cluster at {self.address} exited (code {proc.returncode})")
            self._outq.put(None)
            self._changed.notify_all()

    def _on_message(self, msg: dict[str, Any], gen: int) -> None:
        kind = msg.get("type")
        if kind == "connected":
            self._connected = True
            self._cluster_error = None
            self._ray_version = msg.get("ray_version", "")
            for rec in self._instances.values():  # launched through an earlier bridge: find them again
                if rec["state"] in LIVE and rec["gen"] < gen:
                    rec["gen"] = gen
                    self._send({"op": "adopt", "id": rec["id"]})
        elif kind == "nodes":
            self._nodes = msg["nodes"]
            self._cluster_available = msg.get("cluster_available")
            self._nodes_at = time.monotonic()
            self._machines = {o["machine_id"]: (o, need) for o, need in build_machines(self._nodes, self.node_resource)}
        elif kind == "instance":
            rec = self._instances.setdefault(msg["id"], self._record(msg["id"], None, "adopting"))
            for key, val in msg.items():
                if key not in ("type", "id") and (val is not None or key == "exit_code"):
                    rec[key] = val
            rec["updated"] = time.time()
        elif kind == "cluster_lost":
            self._cluster_lost(msg.get("message") or f"the Ray cluster at {self.address} is gone")
        elif kind == "fatal":
            self._fatal = msg.get("message") or "the Ray bridge cannot run"
            self._cluster_error = self._fatal

    def _cluster_lost(self, message: str) -> None:
        self._cluster_error = message
        self._connected = False
        for rec in self._instances.values():
            if rec["state"] in LIVE:
                rec["state"], rec["message"], rec["updated"] = "lost", message, time.time()

    def _record(self, instance_id: str, machine_id: str | None, state: str) -> dict[str, Any]:
        return {
            "id": instance_id,
            "machine_id": machine_id,
            "state": state,
            "message": "",
            "gen": self._gen,
            "created": time.time(),
            "updated": time.time(),
        }

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the first picture of the cluster arrives (start-up, CLI, tests); False if the cluster is
        unreachable (then `cluster_error()` says why) or nothing came within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not (self._connected and self._nodes_at) and not self._cluster_error:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))
            return self._connected

    def close(self) -> None:
        """Stop the bridge. Instances (detached actors) keep running: a backend started later adopts them."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
            self._gen += 1
            self._outq.put(None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    # -- the Provider interface ----------------------------------------------------------------------------------------
    def offers(self) -> list[dict[str, Any]]:
        """Machines from the cluster's live nodes (refreshed every `refresh_s` by the bridge); while the cluster is
        unreachable, the last known ones with availability 'unreachable' and nothing free."""
        self._ensure_bridge()
        with self._lock:
            out = []
            for offer, need in self._machines.values():
                o = {**offer, "ray_address": self.address}
                if self._cluster_error:
                    o.update(available=0, availability="unreachable")
                elif not self._per_node_known():
                    o["available"] = self._free_estimate(o, need)
                    o["availability"] = "available" if o["available"] else "busy"
                out.append(o)
            return out

    def _per_node_known(self) -> bool:
        return any(n.get("available") is not None for n in self._nodes)

    def _free_estimate(self, offer: dict[str, Any], need: dict[str, float]) -> int:
        """Free instances of a machine when Ray does not say per node (Ray Client): from the cluster's free
        resources (blind to how they are split over nodes), else from what this backend itself holds."""
        if self._cluster_available is not None:
            return min(int(offer["capacity"]), fits(need, self._cluster_available))
        mine = sum(1 for r in self._instances.values() if r["machine_id"] == offer["machine_id"] and r["state"] in LIVE)
        return max(0, int(offer["capacity"]) - mine)

    def reservation(self, machine_id: str) -> dict[str, float] | None:
        """The Ray resources one instance of `machine_id` holds."""
        with self._lock:
            found = self._machines.get(machine_id)
            return dict(found[1]) if found else None

    def launch(self, instance_id: str, machine_id: str, env: dict[str, str], user_id: int | None = None) -> None:
        """Ask the cluster for the machine's resources and start the agent there; returns at once (no pid: the
        instance lives on a node). A machine busy now stays pending until Ray can place it (see `pending`)."""
        self._ensure_bridge()
        with self._lock:
            if self._cluster_error:
                raise RayClusterError(self.address, self._cluster_error)
            found = self._machines.get(machine_id)
            if found is None:
                offered = ", ".join(sorted(self._machines)) or "none yet"
                raise ValueError(
                    f"{machine_id} is not a machine of the Ray cluster at {self.address} (no live node can hold it; "
                    f"offered: {offered})"
                )
            env = dict(env)
            if self.backend_url:
                env["AIBRO_WORKER_URL"] = self.backend_url
            spec = {
                "instance_id": instance_id,
                "env": env,
                "user_id": user_id,
                "argv": self.worker_command,
                "worker_root": self.worker_root,
                "sandbox": self.sandbox,
                "linger_s": self.linger_s,
            }
            self._instances[instance_id] = self._record(instance_id, machine_id, "starting")
            self._send({"op": "launch", "id": instance_id, "need": found[1], "spec": spec})
        return None

    def alive(self, instance: dict[str, Any]) -> bool:
        """False once the agent exited, was terminated, or its node or the whole cluster is gone (see
        `lost_reason`). An instance the provider does not know (the backend restarted) is looked up by name."""
        self._ensure_bridge()
        instance_id = instance["id"]
        with self._lock:
            rec = self._instances.get(instance_id)
            if rec is None:
                if self._cluster_error:
                    return False
                rec = self._instances[instance_id] = self._record(instance_id, instance.get("machine_id"), "adopting")
                self._send({"op": "adopt", "id": instance_id})
            return rec["state"] in LIVE

    def terminate(self, instance: dict[str, Any]) -> None:
        """Stop the agent and kill the actor, which frees the reservation (repeated calls are harmless)."""
        self._ensure_bridge()
        instance_id = instance["id"]
        with self._lock:
            rec = self._instances.get(instance_id)
            if rec is not None and rec["state"] not in LIVE:
                return
            if rec is None:
                rec = self._instances[instance_id] = self._record(
                    instance_id, instance.get("machine_id"), "terminating"
                )
            if self._cluster_error:
                rec["state"], rec["message"] = "lost", self._cluster_error
                return
            self._send({"op": "terminate", "id": instance_id})

    def reap(self) -> None:
        """Restart the bridge when it is gone (the cluster came back), and forget instances closed long ago."""
        self._ensure_bridge()
        cutoff = time.time() - 3600
        with self._lock:
            for instance_id in [
                i for i, r in self._instances.items() if r["state"] not in LIVE and r["updated"] < cutoff
            ]:
                del self._instances[instance_id]
                self._send({"op": "forget", "id": instance_id})

    # -- what the scheduler and the instances view may read -----------------------------------------------------------
    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes as last seen: id, ip, hostname, total and available resources."""
        with self._lock:
            return [dict(n) for n in self._nodes]

    def cluster_error(self) -> str | None:
        """Why the cluster cannot be used now (it names the address), or None."""
        with self._lock:
            return self._cluster_error

    def pending(self, instance: dict[str, Any]) -> str | None:
        """While Ray cannot place the instance yet: what it waits for, e.g. 'waiting for 1 GPU on the Ray
        cluster (HOST:PORT)'. None once placed (or when it is not waiting for resources)."""
        with self._lock:
            rec = self._instances.get(instance["id"])
            if rec is None or rec["state"] not in ("starting", "pending") or rec.get("placed_node"):
                return None
            found = self._machines.get(rec["machine_id"] or "")
            if found is None:
                return f"waiting for {rec['machine_id']} on the Ray cluster ({self.address}): no live node can hold it"
            offer, need = found
            if self._per_node_known():
                room = any(fits(need, n["available"]) for n in self._nodes if n.get("available") is not None)
            else:
                room = self._cluster_available is None or fits(need, self._cluster_available) > 0
            if room:
                return None  # the cluster has room: Ray is placing it (our own placed actors count as placed)
            return self.waiting_for(rec["machine_id"])

    def waiting_for(self, machine_id: str) -> str | None:
        """What a job waits for while every instance of `machine_id` the cluster can hold is in use."""
        with self._lock:
            found = self._machines.get(machine_id)
        return f"waiting for {need_text(found[0])} on the Ray cluster ({self.address})" if found else None

    def lost_reason(self, instance: dict[str, Any]) -> str | None:
        """Why a dead instance ended: its node died, the worker exited, or the cluster is gone (names the address)."""
        with self._lock:
            rec = self._instances.get(instance["id"])
            if rec is None:
                return self._cluster_error
            if rec["state"] in LIVE:
                return None
            return rec.get("message") or rec["state"]

    def info(self, instance: dict[str, Any]) -> dict[str, Any]:
        """Where an instance runs, for the instances view: state, node id and ip, hostname, agent pid, GPU ids."""
        with self._lock:
            rec = dict(self._instances.get(instance["id"]) or {"state": "unknown"})
        rec.pop("gen", None)
        rec["ray_address"] = self.address
        if rec.get("state") in ("starting", "pending"):
            rec["waiting"] = self.pending(instance)
        return rec
