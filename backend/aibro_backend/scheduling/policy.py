"""Per-user limits (DESIGN.md "Policy"), overridable by environment for a shared backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Annotated

from pydantic import Field

from aibro_core.envsettings import read_env

Count = Annotated[int, Field(ge=1)]
Cap = Annotated[int, Field(ge=0)]  # 0 holds everything back (an operator pausing a backend)
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
ENV = {
    "max_active_jobs": "AIBRO_MAX_ACTIVE_JOBS",
    "max_active_instances": "AIBRO_MAX_ACTIVE_INSTANCES",
    "max_stopped_instances": "AIBRO_MAX_STOPPED_INSTANCES",
    "max_job_bytes": "AIBRO_MAX_JOB_BYTES",
    "max_attempts": "AIBRO_MAX_ATTEMPTS",
    "cancel_grace_s": "AIBRO_CANCEL_GRACE_S",
    "max_cool_down_s": "AIBRO_MAX_COOL_DOWN_S",
    "allow_unsafe": "AIBRO_ALLOW_UNSAFE",
    "spare_worker": "AIBRO_SPARE_WORKER",
}


@dataclass(frozen=True)
class Policy:
    max_active_jobs: Cap = 5
    max_active_instances: Cap = 5
    max_stopped_instances: Cap = 4
    max_job_bytes: Count = 2 * 1024**3
    max_attempts: Count = 3
    cancel_grace_s: Seconds = 20.0
    max_cool_down_s: Seconds = 3600.0  # like SageMaker's warm pools: a warm machine is held at most an hour
    allow_unsafe: str = "none"  # who may load models with safe_mode=False: "all", "none" or "alice,bob"
    spare_worker: bool = False  # keep a local worker with TensorFlow imported for the next first job (spare.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Policy:
        """The policy from AIBRO_* variables (ENV); SettingsError names every wrong one at once."""
        return read_env(cls, ENV, os.environ if env is None else env)

    def unsafe_allowed(self, user: str) -> bool:
        """Whether `user` may run models with safe_mode=False (Lambda layers run their Python on the worker).
        On by default for the embedded single-user backend, off for `aibro backend serve`."""
        allowed = {u.strip() for u in self.allow_unsafe.split(",") if u.strip()}
        return "all" in allowed or user in allowed

    def as_dict(self) -> dict:
        return asdict(self)
