"""The Ray provider against a real Ray cluster started on this host (nothing faked): a head and worker nodes joined
with `ray start --address`, each with 1 CPU and a custom resource so placement can be checked. Offers built from
the nodes, an agent started on a node with the reserved resources and only its allow-listed environment, two
instances spread over two nodes and a third pending with its waiting message, terminate and agent exit freeing the
reservation, the real agent reaching its backend over HTTP, a node joining, a node's process group killed, the
whole cluster stopped.
The cluster (tests/ray_cluster.py) is started once for the module.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_cluster import POOL, SECRET, RayCluster, free_port, ray_available, start_cluster
from records import record

from aibro_backend.providers.base import LaunchRequest
from aibro_backend.providers.ray import (
    RayClusterError,
    RayProvider,
    build_machines,
    fits,
    gcs_refusal,
    need_text,
)
from aibro_backend.providers.sandbox import Sandbox
from aibro_core.models import Machine

pytestmark = pytest.mark.timeout(400)

# A tiny stand-in for the agent: writes its environment, then waits for a `stop` file (exit 7) in its directory.
FAKE_AGENT = [
    sys.executable,
    "-c",
    "import json, os, pathlib, sys, time\n"
    "d = pathlib.Path(os.environ['AIBRO_WORKER_DIR'])\n"
    "(d / 'env.json').write_text(json.dumps(dict(os.environ)))\n"
    "while not (d / 'stop').exists():\n"
    "    time.sleep(0.1)\n"
    "sys.exit(7)\n",
]


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 30.0, every: float = 0.1) -> float:
    """Seconds until `cond()` is true; fails with `what` after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(every)
    return time.monotonic() - t0


def offer(provider: RayProvider, machine_id: str) -> dict[str, Any] | None:
    """The machine as GET /machines shows it."""
    return next((o.model_dump() for o in provider.offers() if o.machine_id == machine_id), None)


def node_id(provider: RayProvider, resource: str) -> str:
    return next(n["node_id"] for n in provider.nodes() if n["total"].get(resource))


def env_for(instance_id: str) -> dict[str, str]:
    return {
        "AIBRO_WORKER_URL": "http://127.0.0.1:9",
        "AIBRO_WORKER_TOKEN": f"aibro_w_{instance_id}",
        "AIBRO_INSTANCE_ID": instance_id,
        "AIBRO_SOMETHING_ELSE": "not allow-listed",
    }


def state(provider: RayProvider, instance_id: str) -> str:
    return provider.info(record(instance_id))["state"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    # Two worker nodes: "a" (CPU only) and "b" (1 CPU, 1 GPU that Ray reports as a T4).
    with start_cluster({"a": {}, "b": {"gpus": 1, "resources": {"accelerator_type:T4": 1}}}) as c:
        yield c


@pytest.fixture(scope="module")
def provider(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayProvider]:
    p = RayProvider(
        cluster.address,
        tmp_path_factory.mktemp("ray-state"),
        worker_command=FAKE_AGENT,
        worker_root=str(tmp_path_factory.mktemp("ray-workers")),
        node_resource=POOL,
        sandbox="none",
        refresh_s=1.0,
    )
    try:
        assert p.wait_ready(60), p.cluster_error()
        wait_for("both worker nodes in the picture", lambda: len(p.nodes()) == 3)
        yield p
    finally:
        p.close()


# -- the marketplace from node resources (no cluster needed) --------------------------------------------------------
def _node(cpu: float, gpu: float = 0, types: tuple[str, ...] = (), alive: bool = True, **extra: float) -> dict:
    total = {"CPU": cpu, "memory": 16 * 2**30, **extra}
    if gpu:
        total["GPU"] = gpu
    total.update({f"accelerator_type:{t}": 1.0 for t in types})
    return {"node_id": f"n{cpu}{gpu}{types}", "alive": alive, "total": total, "available": dict(total)}


def test_machines_from_node_resources() -> None:
    nodes = [_node(8), _node(4, 2, ("A100",)), _node(16, 4, ("T4",)), _node(64, alive=False)]
    machines = {o["machine_id"]: (o, need) for o, need in build_machines(nodes)}
    # CPU machines in powers of two up to the largest live node (the dead 64-CPU node counts for nothing).
    assert [m for m in machines if m.startswith("ray-cpu")] == [
        "ray-cpu1",
        "ray-cpu2",
        "ray-cpu4",
        "ray-cpu8",
        "ray-cpu16",
    ]
    assert machines["ray-cpu4"][0]["capacity"] == 2 + 1 + 4 and machines["ray-cpu16"][0]["nodes"] == 1
    # Any GPU, and each reported type pinned by its accelerator resource when the cluster has several.
    gpu1, need = machines["ray-gpu1"]
    assert (gpu1["gpu_type"], gpu1["gpu_count"], gpu1["vcpus"], gpu1["capacity"]) == ("A100/T4", 1, 1, 6)
    assert need == {"GPU": 1.0, "CPU": 1.0}
    assert machines["ray-gpu4"][0]["gpu_type"] == "T4" and "ray-gpu8" not in machines
    assert machines["ray-gpu2-a100"][1]["accelerator_type:A100"] > 0 and "ray-gpu4-a100" not in machines
    assert machines["ray-gpu4-t4"][0]["capacity"] == 1
    for o, _ in machines.values():
        assert o["provider"] == "ray" and o["price_per_hour"] == 0.0 and o["memory_gib"] == 16.0
        assert Machine(**o).model_dump(exclude_unset=True) == o, "offers() and GET /machines show it as built"
    assert need_text(gpu1) == "1 GPU" and need_text(machines["ray-gpu2-a100"][0]) == "2 A100 GPUs"
    assert need_text(machines["ray-cpu4"][0]) == "4 CPUs"
    # Free now: from the nodes' available resources.
    nodes[0]["available"]["CPU"] = 3
    assert {o["machine_id"]: o["available"] for o, _ in build_machines(nodes)}["ray-cpu4"] == 0 + 1 + 4
    # A node pool: only nodes with the custom resource count, and each instance takes a sliver of it.
    pooled = {o["machine_id"]: (o, need) for o, need in build_machines(nodes, node_resource="pool")}
    assert pooled == {}
    nodes[1]["total"]["pool"] = 1
    pooled = {o["machine_id"]: (o, need) for o, need in build_machines(nodes, node_resource="pool")}
    assert sorted(pooled) == ["ray-cpu1", "ray-cpu2", "ray-cpu4", "ray-gpu1", "ray-gpu2"]
    assert pooled["ray-gpu1"][0]["gpu_type"] == "A100" and pooled["ray-cpu1"][1]["pool"] > 0
    assert fits({"CPU": 2, "pool": 0.001}, {"CPU": 5, "pool": 1}) == 2 and fits({"GPU": 1}, {"CPU": 4}) == 0


def test_unreachable_address_is_named(tmp_path: Path) -> None:
    ray_available()
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert gcs_refusal(address) and gcs_refusal("ray://" + address) and gcs_refusal("auto") is None
    p = RayProvider(address, tmp_path, reconnect_s=60)
    try:
        assert not p.wait_ready(30)
        assert address in (p.cluster_error() or "")
        with pytest.raises(RayClusterError, match=address.replace(".", r"\.")):
            p.launch(LaunchRequest("inst-x", "ray-cpu1", env_for("inst-x")))
        assert p.offers() == [] and not p.alive(record("inst-x"))
    finally:
        p.close()
    with pytest.raises(ValueError, match="address"):
        RayProvider(" ", tmp_path)
    # Ray is imported by the bridge process only: the backend process (and the notebook) never load it.
    probe = (
        "import sys, pathlib\n"
        "from aibro_backend.providers.ray import RayProvider\n"
        f"p = RayProvider({address!r}, pathlib.Path({str(tmp_path / 'probe')!r}), reconnect_s=60)\n"
        "p.wait_ready(30); p.offers(); p.close()\n"
        "print('ray' in sys.modules, p.cluster_error() is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stderr


# -- a real cluster -------------------------------------------------------------------------------------------------
def test_offers_from_the_cluster_nodes(cluster: RayCluster, provider: RayProvider, tmp_path: Path) -> None:
    offers = {o.machine_id: o.model_dump() for o in provider.offers()}
    # The pool is nodes a and b (1 CPU each; b with 1 T4): nothing bigger than a node is offered.
    assert sorted(offers) == ["ray-cpu1", "ray-gpu1"]
    cpu, gpu = offers["ray-cpu1"], offers["ray-gpu1"]
    assert (cpu["vcpus"], cpu["gpu_count"], cpu["capacity"], cpu["available"], cpu["nodes"]) == (1, 0, 2, 2, 2)
    assert (gpu["gpu_type"], gpu["gpu_count"], gpu["capacity"], gpu["available"]) == ("T4", 1, 1, 1)
    for o in offers.values():
        assert o["provider"] == "ray" and o["price_per_hour"] == 0.0 and o["on_demand_price_per_hour"] == 0.0
        assert o["memory_gib"] > 0 and o["availability"] == "available" and o["ray_address"] == cluster.address
    with pytest.raises(ValueError, match="ray-cpu2 is not a machine of the Ray cluster"):
        provider.launch(LaunchRequest("inst-big", "ray-cpu2", env_for("inst-big")))
    # Without a pool, the head's CPU counts too.
    whole = RayProvider(cluster.address, tmp_path, worker_command=FAKE_AGENT, sandbox="none", refresh_s=1.0)
    try:
        assert whole.wait_ready(60), whole.cluster_error()
        assert (offer(whole, "ray-cpu1") or {}).get("capacity") == 3
    finally:
        whole.close()


def test_instance_runs_the_agent_with_its_env_on_a_node_holding_the_reservation(
    cluster: RayCluster, provider: RayProvider
) -> None:
    inst = record("inst-gpu")
    provider.launch(LaunchRequest("inst-gpu", "ray-gpu1", env_for("inst-gpu"), user_id=3))
    assert provider.alive(inst)
    wait_for("the GPU instance running", lambda: state(provider, "inst-gpu") == "running")
    info = provider.info(inst)
    assert info["node_id"] == node_id(provider, "b")  # the only node with a GPU
    assert info["node_ip"] and info["pid"] and info["gpu_ids"] == ["0"] and info["ray_address"] == cluster.address
    workdir = Path(info["workdir"])
    wait_for("the agent's environment file", lambda: (workdir / "env.json").exists())
    env = json.loads((workdir / "env.json").read_text())
    assert env["AIBRO_WORKER_TOKEN"] == "aibro_w_inst-gpu" and env["AIBRO_INSTANCE_ID"] == "inst-gpu"
    assert env["AIBRO_WORKER_URL"] == "http://127.0.0.1:9" and env["AIBRO_WORKER_DIR"] == str(workdir)
    assert env["AIBRO_ENV_CACHE"] == str(workdir.parent.parent / "envs" / "u3")
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # the GPU Ray gave the actor
    leaked = sorted(k for k in env if k.startswith("RAY") or k in ("PYTHONPATH", "AIBRO_TOKEN", "AIBRO_SOMETHING_ELSE"))
    assert leaked == [] and SECRET not in json.dumps(env)
    # While it runs the GPU is held; when the agent exits on its own (as when the backend says exit), the
    # instance is over and the reservation is freed.
    wait_for("the GPU held", lambda: (offer(provider, "ray-gpu1") or {}).get("available") == 0)
    (workdir / "stop").touch()
    took = wait_for("the instance over after its agent exits", lambda: not provider.alive(inst))
    assert provider.lost_reason(inst) == "the worker exited with code 7" and took < 10
    wait_for("the GPU free again", lambda: (offer(provider, "ray-gpu1") or {}).get("available") == 1)


def test_instances_spread_over_nodes_and_a_third_waits(cluster: RayCluster, provider: RayProvider) -> None:
    ids = ["inst-c1", "inst-c2", "inst-c3"]
    for i in ids[:2]:
        provider.launch(LaunchRequest(i, "ray-cpu1", env_for(i), user_id=1))
    wait_for("two CPU instances running", lambda: all(state(provider, i) == "running" for i in ids[:2]))
    nodes = {provider.info(record(i))["node_id"] for i in ids[:2]}
    assert nodes == {node_id(provider, "a"), node_id(provider, "b")}  # one per node, each node has 1 CPU
    wait_for("nothing free", lambda: (offer(provider, "ray-cpu1") or {}).get("available") == 0)
    provider.launch(LaunchRequest("inst-c3", "ray-cpu1", env_for("inst-c3"), user_id=1))
    waiting = f"waiting for 1 CPU on the Ray cluster ({cluster.address})"
    wait_for("the third waiting", lambda: provider.pending(record("inst-c3")) == waiting)
    time.sleep(2)  # it stays waiting, alive, not failed
    assert provider.alive(record("inst-c3")) and state(provider, "inst-c3") == "pending"
    assert provider.info(record("inst-c3"))["waiting"] == waiting
    # Terminate frees the reservation: the waiting one takes the freed node.
    freed = provider.info(record("inst-c1"))["node_id"]
    provider.terminate(record("inst-c1"))
    wait_for("the first one gone", lambda: not provider.alive(record("inst-c1")), timeout=15)
    wait_for("the third running", lambda: state(provider, "inst-c3") == "running")
    assert provider.info(record("inst-c3"))["node_id"] == freed and provider.pending(record("inst-c3")) is None
    for i in ids[1:]:
        provider.terminate(record(i))
    wait_for("all gone", lambda: not any(provider.alive(record(i)) for i in ids), timeout=15)
    wait_for("both CPUs free", lambda: (offer(provider, "ray-cpu1") or {}).get("available") == 2)


def test_an_ended_instance_leaves_only_its_log_on_its_node(cluster: RayCluster, provider: RayProvider) -> None:
    """What an instance leaves under the node's worker root once its agent has ended: its folder (token, data, code,
    outputs) goes and its log stays as `worker-logs/<instance>.log`, as the local provider keeps it; the folder of
    an actor killed before it could remove it goes at the next instance's start there, never that of one alive."""
    ids = ["inst-f1", "inst-f2", "inst-f3"]
    for i in ids[:2]:
        provider.launch(LaunchRequest(i, "ray-cpu1", env_for(i), user_id=1))
    wait_for("two instances running", lambda: all(state(provider, i) == "running" for i in ids[:2]), timeout=60)
    f1, f2 = (Path(provider.info(record(i))["workdir"]) for i in ids[:2])
    root = f1.parent.parent
    wait_for("their agents writing", lambda: (f1 / "env.json").exists() and (f2 / "env.json").exists())
    (f1 / "stop").touch()  # its agent exits on its own
    wait_for("the first over", lambda: not provider.alive(record("inst-f1")))
    assert not f1.exists() and (root / "worker-logs" / "inst-f1.log").exists(), sorted(root.rglob("*"))
    assert oct((root / "worker-logs" / "inst-f1.log").stat().st_mode & 0o777) == "0o600"
    agent = provider.info(record("inst-f2"))["pid"]
    actor = int(Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the agent's parent
    os.kill(actor, signal.SIGKILL)  # no time to clean: the fault
    wait_for("the second lost", lambda: not provider.alive(record("inst-f2")), timeout=30)
    assert f2.exists(), "an actor killed outright removes nothing"
    provider.launch(LaunchRequest("inst-f3", "ray-cpu1", env_for("inst-f3"), user_id=1))
    wait_for("the third running", lambda: state(provider, "inst-f3") == "running", timeout=60)
    wait_for("the killed one's folder swept by the next start", lambda: not f2.exists())
    f3 = Path(provider.info(record("inst-f3"))["workdir"])
    assert f3.exists() and (root / "worker-logs" / "inst-f2.log").exists()
    provider.terminate(record("inst-f3"))
    wait_for("the third terminated", lambda: not provider.alive(record("inst-f3")), timeout=15)
    wait_for("a terminated one's folder gone", lambda: not f3.exists())
    assert sorted(p.name for p in (root / "workers").iterdir()) == [], "nothing of the three is left"
    assert {p.name for p in (root / "worker-logs").iterdir()} >= {f"{i}.log" for i in ids}


class _Backend(http.server.BaseHTTPRequestHandler):
    """Answers the agent's first poll with 'exit' and records what it asked: enough to see it reach us."""

    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Backend.seen.append((self.path, self.headers.get("Authorization", "")))
        body = json.dumps({"action": "exit"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_real_agent_reaches_the_backend_over_http(cluster: RayCluster, tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # The default command (`python -I -m aibro_backend.worker` of the node's Ray Python) in the default sandbox.
    p = RayProvider(
        cluster.address,
        tmp_path / "state",
        worker_root=str(tmp_path / "workers"),
        node_resource=POOL,
        backend_url=f"http://127.0.0.1:{server.server_address[1]}",
        refresh_s=1.0,
    )
    try:
        assert p.wait_ready(60), p.cluster_error()
        p.launch(LaunchRequest("inst-real", "ray-cpu1", env_for("inst-real"), user_id=2))
        wait_for("the agent's exit", lambda: not p.alive(record("inst-real")), timeout=90, every=0.3)
        assert not (tmp_path / "workers" / "workers" / "inst-real").exists(), "its folder went with it"
        log = (tmp_path / "workers" / "worker-logs" / "inst-real.log").read_text()  # kept, as local workers' are
        assert p.lost_reason(record("inst-real")) == "the worker exited with code 0", log
        assert ("/api/v1/worker/assignment", "Bearer aibro_w_inst-real") in _Backend.seen, log
        assert "instance closing; exiting" in log
        # Confined on its node as a local worker would be on this host (bubblewrap when it works here).
        assert p.info(record("inst-real"))["sandbox"] == Sandbox.choose(sys.executable).kind
    finally:
        p.close()
        server.shutdown()


def test_a_restarted_backend_adopts_its_running_instances(cluster: RayCluster, tmp_path: Path) -> None:
    def make() -> RayProvider:
        p = RayProvider(
            cluster.address,
            tmp_path,
            worker_command=FAKE_AGENT,
            worker_root=str(tmp_path / "workers"),
            node_resource=POOL,
            sandbox="none",
            refresh_s=1.0,
        )
        assert p.wait_ready(60), p.cluster_error()
        return p

    first = make()
    first.launch(LaunchRequest("inst-kept", "ray-cpu1", env_for("inst-kept"), user_id=1))
    wait_for("the instance running", lambda: state(first, "inst-kept") == "running")
    before = first.info(record("inst-kept"))
    first.close()  # the backend goes away; its detached actor and agent stay
    second = make()
    try:
        inst = record("inst-kept", "ray-cpu1")
        assert second.alive(inst)  # from the store's row: looked up by name
        wait_for("adopted", lambda: state(second, "inst-kept") == "running")
        after = second.info(inst)
        assert (after["node_id"], after["pid"]) == (before["node_id"], before["pid"])
        assert not (Path(before["workdir"]) / "stop").exists() and Path(f"/proc/{before['pid']}").exists()
        wait_for("an unknown one found gone", lambda: not second.alive(record("inst-never")))
        assert "no Ray actor aibro-inst-never" in (second.lost_reason(record("inst-never")) or "")
        second.terminate(inst)
        wait_for("terminated", lambda: not second.alive(inst), timeout=15)
        wait_for("both CPUs free", lambda: (offer(second, "ray-cpu1") or {}).get("available") == 2)
    finally:
        second.close()


def test_offers_follow_a_node_joining(cluster: RayCluster, provider: RayProvider) -> None:
    cluster.node("c")
    took = wait_for("node c in the offers", lambda: (offer(provider, "ray-cpu1") or {}).get("capacity") == 3)
    assert took < 10 and (offer(provider, "ray-cpu1") or {})["nodes"] == 3


def test_killing_a_node_loses_its_instance_within_seconds(cluster: RayCluster, provider: RayProvider) -> None:
    inst = record("inst-doomed")
    provider.launch(LaunchRequest("inst-doomed", "ray-gpu1", env_for("inst-doomed"), user_id=1))
    wait_for("the GPU instance running", lambda: state(provider, "inst-doomed") == "running")
    info = provider.info(inst)
    assert info["node_id"] == node_id(provider, "b")
    cluster.kill("b")  # SIGKILL to node b's `ray start` process group
    took = wait_for("alive() false", lambda: not provider.alive(inst), timeout=20)
    print(f"\nnode loss noticed after {took:.1f} s")
    assert took < 10
    reason = provider.lost_reason(inst) or ""
    assert info["node_ip"] in reason and "node" in reason and provider.cluster_error() is None
    wait_for("the agent gone with its node", lambda: not Path(f"/proc/{info['pid']}").exists(), timeout=10)
    # The node leaves the marketplace once Ray declares it dead: no GPU machine any more, 2 CPU nodes left.
    wait_for("node b out of the offers", lambda: offer(provider, "ray-gpu1") is None, timeout=40)
    assert (offer(provider, "ray-cpu1") or {}).get("capacity") == 2


def test_stopping_the_whole_cluster_is_reported_with_its_address(cluster: RayCluster, provider: RayProvider) -> None:
    inst = record("inst-last")
    provider.launch(LaunchRequest("inst-last", "ray-cpu1", env_for("inst-last"), user_id=1))
    wait_for("the instance running", lambda: state(provider, "inst-last") == "running")
    for name in ("a", "c", "head"):  # what `ray stop` does on each host: SIGTERM to every Ray process
        cluster.kill(name, signal.SIGTERM)
    took = wait_for("alive() false", lambda: not provider.alive(inst), timeout=20)
    print(f"\ncluster loss noticed after {took:.1f} s")
    assert took < 10
    # The node holding it may go first (`ray stop` reaches the nodes one by one): the cluster's loss follows.
    wait_for("the cluster reported lost", lambda: provider.cluster_error(), timeout=20)
    error = provider.cluster_error() or ""
    assert f"the Ray cluster at {cluster.address}" in error
    assert provider.lost_reason(inst) == error
    with pytest.raises(RayClusterError) as exc:
        provider.launch(LaunchRequest("inst-after", "ray-cpu1", env_for("inst-after")))
    assert exc.value.address == cluster.address and cluster.address in str(exc.value)
    assert all(o.availability == "unreachable" and o.model_dump()["available"] == 0 for o in provider.offers())
