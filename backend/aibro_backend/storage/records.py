"""A job and an instance as the store holds them: typed rows the scheduler, the API and the providers read.

What a client sees of them is `aibro_core.models.Job` and `Instance`, built from these by the API (`job_view`,
`instance_view`); a record is never sent as it is (the instance's token hashes never leave the store).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from aibro_core.models import StudySpec
from aibro_core.vocabulary import StudyStatus, TrialStatus


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One row of `jobs`: its spec as validated at submission (api/jobspec.py), its states and progress."""

    id: str
    user_id: int
    status: str
    substatus: str
    spec: dict[str, Any]
    description: str
    created: float
    updated: float
    machine_id: str | None
    instance_id: str | None
    attempt: int
    cancel_requested: bool
    epochs_done: int
    replay_of: str | None

    @classmethod
    def of(cls, row: sqlite3.Row) -> JobRecord:
        fields = {name: row[name] for name in cls.__slots__}
        return cls(**fields | {"spec": json.loads(row["spec"]), "cancel_requested": bool(row["cancel_requested"])})


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One row of `instances`, less its token and enrollment hashes: a machine held for one user.

    `history` holds [status, substatus, ts, job_id] for every transition (costs.py bills from it)."""

    id: str
    user_id: int
    provider: str
    machine_id: str
    status: str
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
        return cls(**{name: row[name] for name in cls.__slots__} | {"history": json.loads(row["history"])})


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
