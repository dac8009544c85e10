"""Store rows under test: providers take the InstanceRecord the scheduler reads from the store; a job row holds a
JobSpec."""

from __future__ import annotations

import time
from typing import Any

from aibro_backend.storage.records import InstanceRecord
from aibro_core import vocabulary as v
from aibro_core.models import JobSpec


def record(instance_id: str, machine_id: str = "", provider: str = "", status: str = v.LAUNCHING) -> InstanceRecord:
    """An instance row as the store would hold it just after its launch."""
    now = time.time()
    return InstanceRecord(
        id=instance_id, user_id=1, provider=provider, machine_id=machine_id, status=status, substatus="", pid=None,
        job_id=None, cool_down_s=0.0, cooling_until=None, created=now, updated=now, last_seen=None,
        history=[[status, "", now]], price_per_hour=0.0,
    )  # fmt: skip


def from_view(view: dict) -> InstanceRecord:
    """The row behind an instance as GET /instances shows it (the view leaves out only its pid)."""
    return InstanceRecord(**{name: view.get(name) for name in InstanceRecord.__slots__})


def job_spec(**fields: Any) -> JobSpec:
    """A valid job spec for a store under test (its data names a blob no one reads), with `fields` set."""
    base = {"model": "1" * 64, "machines": ["local-cpu"], "data": {"x": {"blob": "0" * 64}}}
    return JobSpec.model_validate(base | fields)
