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
    max_cool_down_s: float = 3600.0  # like SageMaker's warm pools: a warm machine is held at most an hour
    allow_unsafe: str = "none"  # who may load models with safe_mode=False: "all", "none" or "alice,bob"
    spare_worker: bool = False  # keep a local worker with TensorFlow imported for the next first job (spare.py)

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
            max_cool_down_s=float(num("AIBRO_MAX_COOL_DOWN_S", cls.max_cool_down_s, float)),
            allow_unsafe=(os.environ.get("AIBRO_ALLOW_UNSAFE") or cls.allow_unsafe).strip(),
            spare_worker=(os.environ.get("AIBRO_SPARE_WORKER") or "0").strip().lower() in ("1", "true", "yes", "on"),
        )

    def unsafe_allowed(self, user: str) -> bool:
        """Whether `user` may run models with safe_mode=False (Lambda layers run their Python on the worker).
        On by default for the embedded single-user backend, off for `aibro backend serve`."""
        allowed = {u.strip() for u in self.allow_unsafe.split(",") if u.strip()}
        return "all" in allowed or user in allowed

    def as_dict(self) -> dict:
        return asdict(self)
