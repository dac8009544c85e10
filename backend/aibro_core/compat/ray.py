"""Ray internals (checked with Ray 2.60.0; see tests/test_compat.py and tests/try_newest.py). Both need a driver
connected to the cluster directly: `ray._private.state` is not served through Ray Client (ray://)."""

from __future__ import annotations

from typing import Any


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """{node id: {resource: amount free now}} from `ray._private.state.available_resources_per_node` (a
    DeveloperAPI): the public `ray.available_resources()` sums the cluster, and which node has room decides where
    an actor can be placed."""
    from ray._private import state

    return state.available_resources_per_node()


def actor_table_entry(actor: Any) -> dict[str, Any]:
    """The GCS actor table's entry of `actor` (its "Address" with the "NodeID" it was placed on, its "Pid"), from
    `ray._private.state.actors` by the handle's `ActorHandle._actor_id`: `ray.util.state.get_actor` answers the
    same only through the dashboard's HTTP server, which a cluster need not run. {} when unknown."""
    from ray._private import state

    return state.actors(actor_id=actor._actor_id.hex()) or {}
