"""The Ray provider's marketplace: machines from the cluster nodes' resources (pure functions: no Ray needed).

`ray-cpuN` and `ray-gpuN` in powers of two up to the largest node, `ray-gpuN-<type>` when nodes report several GPU
types; a machine no live node can hold is not offered. See providers/ray.py for the provider itself."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

FRACTION = 0.001  # how much of a marker resource (node pool, accelerator type) one instance takes


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
