"""The Ray driver, in a process of its own beside the backend (see providers/ray.py for why): it connects to the
cluster, reports its nodes and each instance's actor as JSON lines on a pipe, and runs the backend's commands
(launch, terminate, adopt, forget) read as JSON lines from its stdin. A cluster that stops answering is reported
lost and the process exits at once: a Ray driver without its GCS only hangs, then is terminated by Ray."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
from typing import Any

from aibro_core.compat import ray as ray_compat

from . import shipping
from .ray_actor import InstanceActor

log = logging.getLogger("aibro.ray")

NAMESPACE = "aibro"
ACTOR_PREFIX = "aibro-"
LIVE = frozenset({"starting", "pending", "running", "adopting", "terminating"})
WAIT_SLICE_S = 20.0  # one actor.wait() call: bounded, so a call lost to a network blip never pins a thread
PING_EVERY_S = 1.0
PLACEMENT_EVERY_S = 0.5
INSTALL_HINT = 'pip install "aibro-jupyter[ray]" (or "ray[default]") in the backend\'s environment'


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
                    runtime_env=shipping.ray_runtime_env(),
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
            available = ray_compat.available_resources_per_node()
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
            for t in pending:
                entry = ray_compat.actor_table_entry(t.actor)
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


def bridge_main() -> None:
    """Entry point of the bridge process: `python -c "from aibro_backend.providers.ray import bridge_main; ..."`."""
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ray-bridge %(levelname)s %(message)s")
    out = os.fdopen(int(cfg["fd"]), "w", buffering=1)
    _Bridge(cfg, out).run()
