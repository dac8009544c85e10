"""Per-user limits (DESIGN.md "Policy"), overridable by environment for a shared backend (settings.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from ..settings import DEFAULTS, BackendSettings


@dataclass(frozen=True)
class Policy:
    """What the scheduler holds each user to; the bounds and meaning of each field are in BackendSettings."""

    max_active_jobs: int = DEFAULTS.max_active_jobs
    max_active_instances: int = DEFAULTS.max_active_instances
    max_stopped_instances: int = DEFAULTS.max_stopped_instances
    max_job_bytes: int = DEFAULTS.max_job_bytes
    max_attempts: int = DEFAULTS.max_attempts
    cancel_grace_s: float = DEFAULTS.cancel_grace_s
    max_cool_down_s: float = DEFAULTS.max_cool_down_s
    allow_unsafe: str = DEFAULTS.allow_unsafe
    spare_worker: bool = DEFAULTS.spare_worker
    job_max_memory_bytes: int | None = DEFAULTS.job_max_memory_bytes  # unset: see scheduling/jobmemory.py

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Policy:
        """The policy from AIBRO_* variables; SettingsError names every wrong one at once."""
        return cls.of(BackendSettings.from_env(env))

    @classmethod
    def of(cls, settings: BackendSettings) -> Policy:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def unsafe_allowed(self, user: str) -> bool:
        """Whether `user` may run models with safe_mode=False (Lambda layers run their Python on the worker).
        On by default for the embedded single-user backend, off for `aibro backend serve`."""
        allowed = {u.strip() for u in self.allow_unsafe.split(",") if u.strip()}
        return "all" in allowed or user in allowed

    def as_dict(self) -> dict:
        return asdict(self)
