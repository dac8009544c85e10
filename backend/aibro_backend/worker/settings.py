"""Every AIBRO_* variable the worker agent reads, in one class. Most are a protocol rather than settings: the backend
that launched the worker sets them (its URL, the instance, its tokens and folders); the rest tune the agent.

The worker has no pydantic (a bare Ray node or a cloud machine installs only the agent's few requirements), so each
field is parsed here by its type and bound, and a wrong value is reported as the backend's and the kernel's are: by
its variable, its value and its rule (SettingsError). What one job may take of the machine (AIBRO_JOB_MAX_*) is set
where the backend runs (its settings check them at start) and handed to local workers, which read them here."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from aibro_core.errors import SettingsError

from .joblimits import JobLimits
from .spot import DEFAULT_IMDS_URL, POLL_S

PREFIX = "AIBRO_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def setting(default: Any, doc: str, *, gt: float | None = None, ge: float | None = None, secret: bool = False) -> Any:
    """A field of WorkerSettings: its default, what it does (the README's table), its bound; a secret is never in
    its repr (a log line)."""
    return field(default=default, repr=not secret, metadata={"doc": doc, "gt": gt, "ge": ge})


@dataclass(frozen=True)
class WorkerSettings:
    """The worker agent's settings, from AIBRO_<FIELD>."""

    # -- set by the backend that launched the worker ---------------------------------------------------------------
    worker_url: str | None = setting(None, "The backend's URL, as workers reach it.")
    instance_id: str = setting("worker", "The instance this worker is, in the backend's store.")
    worker_token: str | None = setting(None, "The per-instance token (local workers).", secret=True)
    worker_token_file: Path | None = setting(
        None, "Where an enrolled token is kept (default: worker-token in its folder)."
    )
    enroll_token: str | None = setting(None, "A one-time token exchanged for the worker's own (cloud).", secret=True)
    worker_dir: Path | None = setting(None, "The worker's folder (default: a new temporary one).")
    env_cache: Path | None = setting(None, "Where built requirement environments are kept (default: beside it).")
    worker_net_bridge: Path | None = setting(None, "The folder of the sandbox's sockets to the backend and index.")
    # -- what tunes the agent ----------------------------------------------------------------------------------------
    backend_gone_s: float = setting(900.0, "Seconds the backend may be unreachable before the agent gives up.", gt=0)
    shutdown_on_loss: bool = setting(False, "Shut the machine down when the backend is gone (cloud machines).")
    shutdown_command: str = setting("shutdown -h now", "The command that shuts the machine down.")
    spot_watch: bool = setting(False, "Watch the instance metadata for a spot interruption notice.")
    spot_poll_s: float = setting(POLL_S, "Seconds between two looks at the instance metadata.", gt=0)
    imds_url: str = setting(DEFAULT_IMDS_URL, "The instance metadata service (a fake one in tests).")
    cpu_devices: int = setting(0, "Split the CPU into this many logical devices when over 1 (tests).", ge=0)
    # -- what one job may take of the machine (worker/joblimits.py) -----------------------------------------------
    job_max_open_files: int = setting(JobLimits.max_open_files, "Files a job may hold open.", ge=1)
    job_max_processes: int = setting(JobLimits.max_processes, "Processes and threads of a job.", ge=1)
    job_max_disk_bytes: int = setting(JobLimits.max_disk_bytes, "Bytes a job's folder may hold.", ge=1)
    job_max_memory_bytes: int = setting(
        JobLimits.max_memory_bytes, "Memory of a job's processes (0: no limit); the launching backend sets it.", ge=0
    )

    def job_limits(self) -> JobLimits:
        return JobLimits(
            max_open_files=self.job_max_open_files,
            max_processes=self.job_max_processes,
            max_disk_bytes=self.job_max_disk_bytes,
            max_memory_bytes=self.job_max_memory_bytes,
        )

    @staticmethod
    def variable(name: str) -> str:
        return PREFIX + name.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """The settings from `env` (default os.environ); an unset or empty variable keeps the default, and
        SettingsError names every wrong one at once."""
        env = os.environ if env is None else env
        values, problems = {}, []
        for f in fields(cls):
            raw = (env.get(cls.variable(f.name)) or "").strip()
            if not raw:
                continue
            try:
                values[f.name] = _parse(raw, str(f.type), f.metadata)
            except ValueError as exc:
                problems.append(f"{cls.variable(f.name)}={raw!r}: {exc}")
        if problems:
            raise SettingsError("; ".join(problems) + " (fix them where the worker is started, or unset them)")
        return cls(**values)

    @classmethod
    def documented(cls) -> list[tuple[str, str, Any, str, str]]:
        """(field, variable, default, rule, what it does) of every field, for the README."""
        return [
            (f.name, cls.variable(f.name), None if f.default is MISSING else f.default, _rule(f), f.metadata["doc"])
            for f in fields(cls)
        ]


def _rule(f: Any) -> str:
    kind = str(f.type)
    rule = {"bool": "yes or no (1/0, true/false)", "int": "a whole number", "float": "a number"}.get(kind)
    rule = rule or ("a path" if kind.startswith("Path") else "text")
    bounds = [f"{sign} {f.metadata[key]:g}" for key, sign in (("gt", ">"), ("ge", "≥")) if f.metadata[key] is not None]
    return " ".join([rule, *bounds])


def _parse(raw: str, kind: str, bounds: Mapping[str, Any]) -> Any:
    """`raw` as a field annotated `kind` (its annotation's text: this module's annotations are strings)."""
    if kind == "bool":
        if raw.lower() in TRUE + FALSE:
            return raw.lower() in TRUE
        raise ValueError("set 1 or 0 (true/false, yes/no, on/off)")
    if kind in ("int", "float"):
        number = _number(raw, whole=kind == "int")
        if bounds.get("gt") is not None and not number > bounds["gt"]:
            raise ValueError(f"set a number greater than {bounds['gt']:g}")
        if bounds.get("ge") is not None and not number >= bounds["ge"]:
            raise ValueError(f"set a number of at least {bounds['ge']:g}")
        return number
    return Path(raw) if kind.startswith("Path") else raw


def _number(raw: str, whole: bool) -> float:
    if whole:
        if not raw.lstrip("-").isdigit():
            raise ValueError("set a whole number")
        return int(raw)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("set a number") from None
    if not math.isfinite(value):
        raise ValueError("set a finite number")
    return value
