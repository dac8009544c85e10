"""Per-user limits (DESIGN.md "Policy"), overridable by environment for a shared backend."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Policy:
    max_active_jobs: int = 5
    max_active_instances: int = 5
    max_stopped_instances: int = 4
    max_job_bytes: int = 2 * 1024**3
    max_attempts: int = 3
    cancel_grace_s: float = 20.0

    @classmethod
    def from_env(cls) -> Policy:
        def num(name: str, default: float, kind: type) -> float:
            raw = os.environ.get(name)
            return kind(raw) if raw else default

        return cls(
            max_active_jobs=int(num("AIBRO_MAX_ACTIVE_JOBS", cls.max_active_jobs, int)),
            max_active_instances=int(num("AIBRO_MAX_ACTIVE_INSTANCES", cls.max_active_instances, int)),
            max_stopped_instances=int(num("AIBRO_MAX_STOPPED_INSTANCES", cls.max_stopped_instances, int)),
            max_job_bytes=int(num("AIBRO_MAX_JOB_BYTES", cls.max_job_bytes, int)),
            max_attempts=int(num("AIBRO_MAX_ATTEMPTS", cls.max_attempts, int)),
            cancel_grace_s=float(num("AIBRO_CANCEL_GRACE_S", cls.cancel_grace_s, float)),
        )

    def as_dict(self) -> dict:
        return asdict(self)
