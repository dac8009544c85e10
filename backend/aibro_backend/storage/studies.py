"""Hyperparameter studies (tuning/studies.py), their trials and each trial's executions, each run as a job."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from aibro_core import vocabulary as v

from .records import ExecutionRecord, StudyRecord, TrialRecord
from .sql import owned_rows, row_by_id, transaction, update_row, write


class Studies:
    """The `studies`, `study_trials` and `trial_executions` tables."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def create(self, study_id: str, user_id: int, spec: dict[str, Any], description: str) -> None:
        now = time.time()
        write(
            self.db,
            "INSERT INTO studies (id, user_id, status, spec, description, created, updated) VALUES (?,?,?,?,?,?,?)",
            (study_id, user_id, v.STUDY_RUNNING, json.dumps(spec), description, now, now),
        )

    def get(self, study_id: str, user_id: int | None = None) -> StudyRecord | None:
        row = row_by_id(self.db, "studies", study_id, user_id)
        return StudyRecord.of(row) if row else None

    def list(self, user_id: int | None = None, statuses: tuple[str, ...] | None = None) -> list[StudyRecord]:
        return [StudyRecord.of(r) for r in owned_rows(self.db, "studies", user_id, statuses)]

    def update(self, study_id: str, **fields: Any) -> None:
        update_row(self.db, "studies", {"id": study_id}, fields)

    def add_trial(self, study_id: str, trial_id: str, slot: str, job_id: str, values: dict[str, Any]) -> None:
        """A trial (again, when the oracle retries it) running as `job_id`, its execution 0."""
        now = time.time()
        with transaction(self.db):
            self.db.execute(
                "INSERT OR REPLACE INTO study_trials (study_id, trial_id, slot, job_id, status, trial_values, "
                "created, updated) VALUES (?,?,?,?,?,?,?,?)",
                (study_id, trial_id, slot, job_id, v.TRIAL_RUNNING, json.dumps(values), now, now),
            )
            self.db.execute(  # an earlier run's executions stay the trial's jobs (trial_of_jobs), out of this run
                "UPDATE trial_executions SET execution=-1 WHERE study_id=? AND trial_id=?", (study_id, trial_id)
            )
            self._add_execution(study_id, trial_id, 0, job_id, now)

    def add_execution(self, study_id: str, trial_id: str, execution: int, job_id: str) -> None:
        """The trial's next execution runs as `job_id`: the trial's job from now on."""
        now = time.time()
        with transaction(self.db):
            self._add_execution(study_id, trial_id, execution, job_id, now)
            self.db.execute(
                "UPDATE study_trials SET job_id=?, updated=? WHERE study_id=? AND trial_id=?",
                (job_id, now, study_id, trial_id),
            )

    def _add_execution(self, study_id: str, trial_id: str, execution: int, job_id: str, now: float) -> None:
        """Inside add_trial's or add_execution's transaction."""
        self.db.execute(
            "INSERT OR REPLACE INTO trial_executions (job_id, study_id, trial_id, execution, status, created) "
            "VALUES (?,?,?,?,?,?)",
            (job_id, study_id, trial_id, execution, v.TRIAL_RUNNING, now),
        )

    def update_execution(
        self, job_id: str, status: str, metrics: dict[str, float], best_step: int | None, best_epoch: int | None
    ) -> None:
        """How an execution ended: its metrics at its best epoch, that epoch's index in its History (KerasTuner's
        step) and its number in the job (what its checkpoint is named after: they differ from initial_epoch on)."""
        write(
            self.db,
            "UPDATE trial_executions SET status=?, metrics=?, best_step=?, best_epoch=? WHERE job_id=?",
            (status, json.dumps(metrics), best_step, best_epoch, job_id),
        )

    def executions(self, study_id: str, every_run: bool = False) -> dict[str, list[ExecutionRecord]]:
        """Trial id → its current run's executions, in order; with `every_run`, also an earlier run's (one the
        oracle retried since: execution -1)."""
        rows = self.db.execute(
            "SELECT * FROM trial_executions WHERE study_id=? AND execution >= ? ORDER BY trial_id, execution, created",
            (study_id, -1 if every_run else 0),
        )
        out: dict[str, list[ExecutionRecord]] = {}
        for row in rows.fetchall():
            out.setdefault(row["trial_id"], []).append(ExecutionRecord.of(row))
        return out

    def trials(self, study_id: str) -> list[TrialRecord]:
        rows = self.db.execute("SELECT * FROM study_trials WHERE study_id=? ORDER BY trial_id", (study_id,))
        return [TrialRecord.of(r) for r in rows.fetchall()]

    def trial_of_jobs(self, user_id: int, job_id: str | None = None) -> dict[str, tuple[str, str]]:
        """job id → (study id, trial id) for the user's trial jobs (or that one job): the study's own table says
        which jobs are its trials, not what a job spec claims."""
        sql = (
            "SELECT e.job_id, e.study_id, e.trial_id FROM trial_executions e JOIN studies s ON s.id=e.study_id "
            "WHERE s.user_id=?"
        )
        args: tuple[Any, ...] = (user_id,)
        if job_id is not None:
            sql, args = sql + " AND e.job_id=?", (user_id, job_id)
        return {r[0]: (r[1], r[2]) for r in self.db.execute(sql, args).fetchall()}

    def update_trial(self, study_id: str, trial_id: str, **fields: Any) -> None:
        update_row(self.db, "study_trials", {"study_id": study_id, "trial_id": trial_id}, fields)
