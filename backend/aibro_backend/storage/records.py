"""A job and an instance as the store holds them: typed rows the scheduler, the API and the providers read.

What a client sees of them is `aibro_core.models.Job` and `Instance`, built from these by the API (`job_view`,
`instance_view`); a record is never sent as it is (the instance's token hashes never leave the store).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

from aibro_core.models import JobSpec, StudySpec
from aibro_core.vocabulary import InstanceStatus, JobStatus, JobSubstatus, StudyStatus, TrialStatus


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One row of `jobs`: its spec as validated at submission (api/jobspec.py), its states and progress.

    `spec` is None for a row this version's JobSpec refuses (stored before requests were validated, or by a looser
    release): the scheduler cancels such a job naming why, and `job_view` shows what it can. `status` and
    `substatus` are None for a row a worker spoiled before events were validated (`job_view` shows the event
    log's)."""

    id: str
    user_id: int
    status: JobStatus | None
    substatus: JobSubstatus | None
    spec: JobSpec | None
    description: str
    created: float
    updated: float
    machine_id: str | None
    instance_id: str | None
    attempt: int
    cancel_requested: bool
    epochs_done: int
    replay_of: str | None

    @property
    def checked_spec(self) -> JobSpec:
        """The spec of a job the scheduler runs: every active job's row reads (the scheduler fails one that does not
        first, naming `unreadable_reason`)."""
        if self.spec is None:
            raise ValueError(f"job {self.id}: {unreadable_reason()}")
        return self.spec

    @classmethod
    def of(cls, row: sqlite3.Row) -> JobRecord:
        fields = {name: row[name] for name in cls.__slots__}
        typed = {
            "spec": stored_job_spec(row["spec"]),
            "status": _member(JobStatus, row["status"]),
            "substatus": _member(JobSubstatus, row["substatus"]),
            "cancel_requested": bool(row["cancel_requested"]),
        }
        return cls(**fields | typed)


def _member(enum: type[JobStatus] | type[JobSubstatus], value: str) -> Any:
    return enum(value) if value in {m.value for m in enum} else None


@lru_cache(maxsize=4096)
def stored_job_spec(text: str) -> JobSpec | None:
    """The JobSpec a row holds, validated once per distinct row (a scheduler tick reads every active job), or None
    when this version refuses it. Shared between readers: never modify it, copy it (`model_copy(update=...)`)."""
    try:
        return JobSpec.model_validate_json(text)
    except ValidationError:
        return None


def unreadable_reason() -> str:
    return "its stored spec is one this version of the backend refuses (stored by an older release)"


SPEC_DUMP: dict[str, Any] = {"by_alias": True, "exclude_unset": True}
"""How a JobSpec is written, in the jobs table and in a worker's assignment: what was set, so that validating it
again gives the same spec and the fit arguments the user set are the ones still set (the worker passes only those
to Keras)."""


def job_spec_text(spec: JobSpec) -> str:
    return spec.model_dump_json(**SPEC_DUMP)


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One row of `instances`, less its token and enrollment hashes: a machine held for one user.

    `history` holds [status, substatus, ts, job_id] for every transition (costs.py bills from it)."""

    id: str
    user_id: int
    provider: str
    machine_id: str
    status: InstanceStatus
    substatus: str
    pid: int | None
    job_id: str | None
    cool_down_s: float
    cooling_until: float | None
    created: float
    updated: float
    last_seen: float | None
    history: list[list[Any]]
    price_per_hour: float | None

    @classmethod
    def of(cls, row: sqlite3.Row) -> InstanceRecord:
        typed = {"status": InstanceStatus(row["status"]), "history": json.loads(row["history"])}
        return cls(**{name: row[name] for name in cls.__slots__} | typed)


@dataclass(frozen=True, slots=True)
class StudyRecord:
    """One row of `studies`: a hyperparameter search, its spec (validated again as it is read: the row holds what
    POST /studies was given, less its description) and its state."""

    id: str
    user_id: int
    status: StudyStatus
    spec: StudySpec
    description: str
    message: str | None
    created: float
    updated: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> StudyRecord:
        fields = {name: row[name] for name in cls.__slots__}
        spec = StudySpec.model_validate(json.loads(row["spec"]))
        return cls(**fields | {"status": StudyStatus(row["status"]), "spec": spec})


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One row of `study_trials`: a trial the oracle handed out, the job that runs it, and how it ended."""

    study_id: str
    trial_id: str
    slot: str
    job_id: str
    status: TrialStatus
    values: dict[str, Any]
    score: float | None
    message: str | None
    metrics: dict[str, float]
    best_step: int | None
    created: float
    updated: float
    hyperparameters: dict[str, Any] | None  # KerasTuner's HyperParameters config, once the oracle ended the trial

    @classmethod
    def of(cls, row: sqlite3.Row) -> TrialRecord:
        typed = ("status", "values", "metrics", "hyperparameters")
        fields = {name: row[name] for name in cls.__slots__ if name not in typed}
        hp = json.loads(row["hyperparameters"]) if row["hyperparameters"] else None
        return cls(
            **fields,
            status=TrialStatus(row["status"]),
            values=json.loads(row["trial_values"]),
            metrics=json.loads(row["metrics"]),
            hyperparameters=hp,
        )


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """One row of `trial_executions`: one fit of a trial (KerasTuner's execution), run as its own job."""

    job_id: str
    study_id: str
    trial_id: str
    execution: int  # -1: a run of the trial the oracle retried since
    status: TrialStatus
    metrics: dict[str, float]
    best_step: int | None  # the best epoch's index in its History (KerasTuner's step)
    best_epoch: int | None  # that epoch's number in the job, 0-based: its checkpoint's
    created: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> ExecutionRecord:
        fields = {name: row[name] for name in cls.__slots__ if name not in ("status", "metrics")}
        return cls(**fields, status=TrialStatus(row["status"]), metrics=json.loads(row["metrics"]))
