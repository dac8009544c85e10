"""The Ray provider: each instance is the worker agent, run by a detached Ray actor (which holds the reservation) on
a node of an existing cluster, driven from a bridge process so that a lost cluster never blocks the backend. Why
an actor and not a Ray job or a placement group, how faults surface, and what a cluster must be trusted with:
ARCHITECTURE.md, "The Ray provider". Every node needs `aibro-backend` in the Python that runs Ray; price is 0."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aibro_core.models import Machine

from ..storage.records import InstanceRecord
from .base import LaunchRequest, Provider
from .ray_bridge import INSTALL_HINT, LIVE, NAMESPACE, gcs_refusal
from .ray_machines import build_machines, fits, need_text
from .sandbox import UID_BASE

LOST_WITH_CLUSTER_S = 10.0  # an instance lost this shortly before its whole cluster was lost with the cluster

__all__ = ["RayClusterError", "RayProvider", "RayUnavailable", "build_machines", "fits", "gcs_refusal", "need_text"]


class RayUnavailable(RuntimeError):
    """Ray is not installed where the provider needs it."""


class RayClusterError(RuntimeError):
    """The Ray cluster is gone or unreachable; the message names its address."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


class RayProvider(Provider):
    """An existing Ray cluster as machines: see the module docstring for the how and why.

    `address`: what `ray.init` takes (`HOST:PORT` of the GCS from a host of the cluster, `ray://HOST:10001` through
    Ray Client from elsewhere). `worker_command`: the agent's argv on the node (default: the node's Ray Python,
    `python -I -m aibro_backend.worker`). `backend_url`: the backend's URL as nodes reach it (default: the one the
    scheduler gives). `node_resource`: use only nodes with this custom resource. `worker_root`: where workers'
    private directories live on a node (default `<tmp>/aibro-ray`). `sandbox`: auto | bwrap | none, chosen on
    the node as for local workers, whose users' uids start at `sandbox_uid_base` there too.
    """

    name = "ray"
    enrolls = True  # an actor's arguments are kept by the cluster's GCS, readable there: only a one-time token goes

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
        sandbox_uid_base: int = UID_BASE,
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
        self.sandbox_uid_base = sandbox_uid_base
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
        code = "from aibro_backend.providers.ray_bridge import bridge_main; bridge_main()"
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
        """Every live instance is lost with the cluster; so is one lost moments before (its node went down first,
        as `ray stop` reaches the nodes one by one): the cluster, not the node, is why."""
        self._cluster_error = message
        self._connected = False
        now = time.time()
        for rec in self._instances.values():
            if rec["state"] in LIVE or (rec["state"] == "lost" and now - rec["updated"] < LOST_WITH_CLUSTER_S):
                rec["state"], rec["message"], rec["updated"] = "lost", message, now

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
    def offers(self) -> list[Machine]:
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
                out.append(Machine(**o))
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

    def launch(self, request: LaunchRequest) -> None:
        """Ask the cluster for the machine's resources and start the agent there; returns at once (no pid: the
        instance lives on a node). A machine busy now stays pending until Ray can place it (see `pending`)."""
        instance_id, machine_id = request.instance_id, request.machine_id
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
            env = dict(request.env)
            if self.backend_url:
                env["AIBRO_WORKER_URL"] = self.backend_url
            spec = {
                "instance_id": instance_id,
                "env": env,
                "user_id": request.user_id,
                "argv": self.worker_command,
                "worker_root": self.worker_root,
                "sandbox": self.sandbox,
                "sandbox_uid_base": self.sandbox_uid_base,
                "linger_s": self.linger_s,
            }
            self._instances[instance_id] = self._record(instance_id, machine_id, "starting")
            self._send({"op": "launch", "id": instance_id, "need": found[1], "spec": spec})
        return None

    def alive(self, instance: InstanceRecord) -> bool:
        """False once the agent exited, was terminated, or its node or the whole cluster is gone (see
        `lost_reason`). An instance the provider does not know (the backend restarted) is looked up by name."""
        self._ensure_bridge()
        instance_id = instance.id
        with self._lock:
            rec = self._instances.get(instance_id)
            if rec is None:
                if self._cluster_error:
                    return False
                rec = self._instances[instance_id] = self._record(instance_id, instance.machine_id, "adopting")
                self._send({"op": "adopt", "id": instance_id})
            return rec["state"] in LIVE

    def terminate(self, instance: InstanceRecord) -> None:
        """Stop the agent and kill the actor, which frees the reservation (repeated calls are harmless)."""
        self._ensure_bridge()
        instance_id = instance.id
        with self._lock:
            rec = self._instances.get(instance_id)
            if rec is not None and rec["state"] not in LIVE:
                return
            if rec is None:
                rec = self._instances[instance_id] = self._record(instance_id, instance.machine_id, "terminating")
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

    def pending(self, instance: InstanceRecord) -> str | None:
        """While Ray cannot place the instance yet: what it waits for, e.g. 'waiting for 1 GPU on the Ray
        cluster (HOST:PORT)'. None once placed (or when it is not waiting for resources)."""
        with self._lock:
            rec = self._instances.get(instance.id)
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

    def lost_reason(self, instance: InstanceRecord) -> str | None:
        """Why a dead instance ended: its node died, the worker exited, or the cluster is gone (names the address)."""
        with self._lock:
            rec = self._instances.get(instance.id)
            if rec is None:
                return self._cluster_error
            if rec["state"] in LIVE:
                return None
            return rec.get("message") or rec["state"]

    def info(self, instance: InstanceRecord) -> dict[str, Any]:
        """Where an instance runs, for the instances view: state, node id and ip, hostname, agent pid, GPU ids."""
        with self._lock:
            rec = dict(self._instances.get(instance.id) or {"state": "unknown"})
        rec.pop("gen", None)
        rec["ray_address"] = self.address
        if rec.get("state") in ("starting", "pending"):
            rec["waiting"] = self.pending(instance)
        return rec
