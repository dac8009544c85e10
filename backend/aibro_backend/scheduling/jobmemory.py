"""The memory one job may hold: its worker and every process it starts (worker/joblimits.py measures it and ends
the job over it, naming the limit). Why a default: on a backend several users share, a job with no limit can take
the machine's memory from every other user's job on it. So there, unless the operator sets
AIBRO_JOB_MAX_MEMORY_BYTES, each job gets its share of its machine: this host's memory over the jobs its machines
run at once (the local slots), or a remote machine's own memory (the machine type's). A backend of one user sets
none unless told; 0 sets none anywhere. The scheduler hands the limit to each worker it launches (in its
environment: the variable the worker reads), and GET /health (`aibro backend status`) shows it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from aibro_core.models import Machine

from ..providers.base import Provider
from ..providers.local import LocalProvider, memory_bytes
from ..storage.store import Store
from ..worker.joblimits import GiB, size_text
from .policy import Policy

VARIABLE = "AIBRO_JOB_MAX_MEMORY_BYTES"  # the operator's setting, and what the worker reads (worker/settings.py)


@dataclass(frozen=True)
class JobMemory:
    """What sets each job's memory limit now: the operator's setting, else (on a backend of several users) its
    share of its machine."""

    setting: int | None  # AIBRO_JOB_MAX_MEMORY_BYTES: None when unset, 0 for no limit
    users: int  # users of this backend: more than one makes it shared
    host_bytes: int  # this host's memory
    local_slots: int  # the jobs this host's machines run at once

    @classmethod
    def of(cls, policy: Policy, store: Store, providers: Mapping[str, Provider]) -> JobMemory:
        local = providers.get("local")
        slots = local.slots() if isinstance(local, LocalProvider) else 1
        return cls(policy.job_max_memory_bytes, store.users.count(), memory_bytes(), max(1, slots))

    @property
    def set_by(self) -> Literal["setting", "share", "none"]:
        if self.setting is not None:
            return "setting" if self.setting else "none"
        return "share" if self.users > 1 else "none"

    @property
    def local_share(self) -> int:
        return self.host_bytes // self.local_slots

    def limit(self, offer: Machine | None) -> int:
        """The limit in bytes of a job on `offer` (0: none)."""
        if self.set_by != "share":
            return self.setting or 0
        if offer is None:
            return 0
        if offer.provider == LocalProvider.name:
            return self.local_share
        return int(offer.memory_gib * GiB)  # a remote machine's own memory (0 where its provider does not know it)

    def view(self) -> dict[str, object]:
        """What GET /health says of it (models.JobMemory)."""
        local = self.local_share if self.set_by == "share" else self.setting or None
        if self.set_by == "setting":
            summary = f"{size_text(self.setting or 0)} ({VARIABLE})"
        elif self.set_by == "share":
            summary = (
                f"{size_text(self.local_share)} on this backend's host (its {size_text(self.host_bytes)} over "
                f"{self.local_slots} local slots), a remote machine's own memory on that machine: each job's share, "
                f"as this backend has {self.users} users ({VARIABLE} sets another limit, 0 none)"
            )
        elif self.setting == 0:
            summary = f"not limited ({VARIABLE}=0)"
        else:
            summary = f"not limited, as this backend has one user ({VARIABLE} sets a limit)"
        return {"set_by": self.set_by, "local_bytes": local, "summary": summary}


def launch_limit(policy: Policy, store: Store, providers: Mapping[str, Provider], offer: Machine | None) -> int:
    """AIBRO_JOB_MAX_MEMORY_BYTES for a worker the scheduler launches on `offer`; 0: none to set (no limit, or the
    operator's 0, which a local worker inherits as it is)."""
    return JobMemory.of(policy, store, providers).limit(offer)
