"""Hyperparameter studies (issue 27): each trial KerasTuner's oracle hands out runs as a job of the study's user,
at most `parallel` at once, and each job's end is reported back to the oracle, until it stops handing out.

The driver is the backend's, not the kernel's: a study goes on with the kernel and the browser gone, and after a
backend restart (the oracle's state and the trial→job table are both on disk). One slot per trial allowed to run at
once is KerasTuner's `tuner_id`; a trial that fails is recorded with its error and the study goes on (KerasTuner
stops it after `max_consecutive_failed_trials` failures in a row); cancelling a study cancels its running jobs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture
from aibro_core.models import OracleSpec, Study, StudyTrial

from ..api.base import ApiError
from ..api.user import admit_job
from ..scheduling.costs import job_costs
from ..server.state import Backend
from ..storage.records import JobRecord, StudyRecord, TrialRecord
from .oracle_client import OracleHost, OracleUnavailable
from .oracle_host import OracleRequest

log = logging.getLogger(__name__)
MAX_STEP_FAILURES = 5  # a study whose step fails this many times in a row (not a refusal: a defect) ends FAILED


def study_dir(backend: Backend, study_id: str) -> Path:
    return backend.home / "state" / "studies" / study_id


def create_study(backend: Backend, uid: int, raw: dict[str, Any], spec: Any) -> str:
    """Store a validated StudySpec (`spec`, from `raw`) and write its oracle's spec; the driver starts it."""
    study_id = "study-" + time.strftime("%Y%m%d-") + secrets.token_hex(4)
    OracleHost.create(study_dir(backend, study_id), spec.oracle)
    stored = {"oracle": spec.oracle.model_dump(), "job": raw["job"], "parallel": spec.parallel}
    backend.store.create_study(study_id, uid, stored, spec.description)
    return study_id


def cancel_study(backend: Backend, study: StudyRecord) -> None:
    """The study stops handing out trials; its running trials' jobs are cancelled and the trials marked so."""
    store = backend.store
    if study.status != v.STUDY_RUNNING:
        return
    store.update_study(study.id, status=v.STUDY_CANCELED, message="cancelled")
    for trial in store.trials(study.id):
        if trial.status != v.TRIAL_RUNNING:
            continue
        job = store.job(trial.job_id)
        if job is not None and job.status in v.JOB_ACTIVE and not job.cancel_requested:
            store.update_job(job.id, cancel_requested=1)
            backend.scheduler.emit(job.id, v.EV_LOG, {"message": f"cancel requested (study {study.id} cancelled)"})
        store.update_trial(study.id, trial.trial_id, status=v.TRIAL_CANCELED, message="study cancelled")
    backend.scheduler.tick()


def study_view(backend: Backend, study: StudyRecord) -> Study:
    trials = backend.store.trials(study.id)
    oracle = OracleSpec.model_validate(study.spec["oracle"])
    sign = 1.0 if oracle.objective[0].direction == "min" else -1.0
    scored = [t for t in trials if t.status == v.TRIAL_COMPLETED and t.score is not None]
    best = min(scored, key=lambda t: sign * float(t.score or 0.0)).trial_id if scored else None
    costs = job_costs(backend.store.instances(study.user_id), time.time())
    return Study(
        study_id=study.id,
        status=study.status,  # type: ignore[arg-type]
        description=study.description,
        message=study.message,
        kind=oracle.kind,
        objective=[o.model_dump() for o in oracle.objective],
        max_trials=oracle.max_trials,
        parallel=int(study.spec["parallel"]),
        created=study.created,
        updated=study.updated,
        trials=[
            StudyTrial(
                trial_id=t.trial_id,
                job_id=t.job_id,
                status=t.status,  # type: ignore[arg-type]
                values=t.values,
                score=t.score,
                message=t.message,
                metrics=t.metrics,
                best_step=t.best_step,
            )
            for t in trials
        ],
        best_trial_id=best,
        cost=sum(costs.get(t.job_id, 0.0) for t in trials),
    )


class StudyDriver:
    """Steps every running study: reports ended trials, fills free slots, ends the study when the oracle stops."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.hosts: dict[str, OracleHost] = {}
        self.failures: dict[str, int] = {}
        self.stepping: asyncio.Future[None] | None = None
        self.closed = False

    async def step(self) -> None:
        """One pass over the running studies (never two at once: a slow oracle makes the next pass wait; none once
        the driver is closed, when the store may already be)."""
        if self.stepping is not None or self.closed:
            return
        self.stepping = asyncio.get_running_loop().create_future()
        try:
            for study in self.backend.store.studies(statuses=(v.STUDY_RUNNING,)):
                try:
                    await self._drive(study)
                except OracleUnavailable as exc:
                    self._end_study(study, v.STUDY_FAILED, str(exc))
                except Exception as exc:  # noqa: BLE001 - one study's trouble never stops the others
                    self.failures[study.id] = self.failures.get(study.id, 0) + 1
                    log.exception("study %s: step failed (%d in a row)", study.id, self.failures[study.id])
                    if self.failures[study.id] >= MAX_STEP_FAILURES:
                        self._end_study(study, v.STUDY_FAILED, f"the backend could not drive it: {exc}")
                else:
                    self.failures.pop(study.id, None)
            for study_id in [s for s in self.hosts if self._final(s)]:
                await self.hosts.pop(study_id).close()
        finally:
            self.stepping.set_result(None)
            self.stepping = None

    def _final(self, study_id: str) -> bool:
        study = self.backend.store.study(study_id)
        return study is None or study.status != v.STUDY_RUNNING

    def host(self, study: StudyRecord) -> OracleHost:
        if study.id not in self.hosts:
            store = self.backend.store

            def running() -> dict[str, str]:
                return {t.trial_id: t.slot for t in store.trials(study.id) if t.status == v.TRIAL_RUNNING}

            self.hosts[study.id] = OracleHost(study_dir(self.backend, study.id), running)
        return self.hosts[study.id]

    async def _drive(self, study: StudyRecord) -> None:
        store = self.backend.store
        host = self.host(study)
        for trial in store.trials(study.id):
            job = store.job(trial.job_id) if trial.status == v.TRIAL_RUNNING else None
            if job is not None and job.status in v.JOB_FINAL:
                await self._report(study, host, trial, job)
                if self._final(study.id):
                    return
        busy = {t.slot for t in store.trials(study.id) if t.status == v.TRIAL_RUNNING}
        stopped = 0
        for n in range(int(study.spec["parallel"])):
            slot = f"slot-{n}"
            if slot in busy:
                continue
            got = await host.ask(OracleRequest(op="create_trial", slot=slot))
            if not got.ok or got.trial is None:
                raise OracleUnavailable(got.error or "the oracle answered no trial")
            if got.stopped:
                stopped += 1
            elif got.trial.status == "RUNNING":
                self._start_trial(study, slot, got.trial.trial_id, got.trial.values, host)
        if stopped == int(study.spec["parallel"]) and not busy:
            self._end_study(study, v.STUDY_COMPLETED, None)

    def _start_trial(self, study: StudyRecord, slot: str, trial_id: str, values: dict[str, Any], host: Any) -> None:
        """The trial as a job of the study's user; a job the backend refuses for a limit waits for the next step
        (the oracle hands the same trial to the slot again), one it refuses outright fails the trial."""
        if self._final(study.id):  # cancelled while the oracle answered: nothing starts after a cancel
            return
        job = dict(study.spec["job"])
        job["trial"] = {**job["trial"], "values": values, "study_id": study.id, "trial_id": trial_id}
        if "tuner/epochs" in values:  # Hyperband's round: these epochs, from where the earlier trial stopped
            job["fit"] = {
                **job.get("fit", {}),
                "epochs": int(values["tuner/epochs"]),
                "initial_epoch": int(values.get("tuner/initial_epoch", 0)),
            }
        earlier = values.get("tuner/trial_id")  # Hyperband: start from that trial's trained weights
        if earlier is not None:
            known = {t.trial_id: t.job_id for t in self.backend.store.trials(study.id)}
            if str(earlier) in known:
                job["trial"]["resume_job"] = known[str(earlier)]
        job["description"] = f"{study.description or study.id} · trial {trial_id}"
        user = self.backend.store.user_name(study.user_id) or ""
        try:
            job_id = admit_job(self.backend, study.user_id, user, job)
        except ApiError as exc:
            if exc.status != 429:  # refused outright (the policy changed since the study began): every trial would be
                self._end_study(study, v.STUDY_FAILED, f"trial {trial_id}'s job was refused: {exc}")
            return
        self.backend.store.add_trial(study.id, trial_id, slot, job_id, values)
        log.info("study %s: trial %s runs as %s (%s)", study.id, trial_id, job_id, slot)

    async def _report(self, study: StudyRecord, host: OracleHost, trial: TrialRecord, job: JobRecord) -> None:
        """Tell the oracle how the trial's job ended: its metrics at the best epoch by the objective (as KerasTuner
        reports a History), or its error."""
        store = self.backend.store
        if job.status == v.COMPLETED:
            metrics, best_step, why = best_epoch_metrics(store.typed_events(job.id, (v.EV_EPOCH,)), study)
            status, message = ("COMPLETED", None) if why is None else ("FAILED", why)
        else:
            errors = store.typed_events(job.id, (v.EV_ERROR,))
            metrics, best_step, status = {}, None, "FAILED"
            message = errors[-1]["data"].get("message") if errors else "the job was cancelled"
        got = await host.ask(
            OracleRequest(
                op="end_trial",
                trial_id=trial.trial_id,
                status=status,
                metrics=metrics,
                step=best_step or 0,
                message=message,
            )
        )
        ended = got.trial
        store.update_trial(
            study.id,
            trial.trial_id,
            status=v.TRIAL_COMPLETED if status == "COMPLETED" and ended and ended.score is not None else v.TRIAL_FAILED,
            score=ended.score if ended else None,
            message=message if status != "COMPLETED" else None,
            metrics=json.dumps(metrics),
            best_step=best_step,
        )
        if not got.ok and "already" not in (got.error or ""):
            self._end_study(study, v.STUDY_FAILED, got.error)

    def _end_study(self, study: StudyRecord, status: str, message: str | None) -> None:
        if status == v.STUDY_FAILED:
            cancel_study(self.backend, study)
        self.backend.store.update_study(study.id, status=status, message=message)
        log.info("study %s %s%s", study.id, status, f": {message}" if message else "")

    async def close(self) -> None:
        """Stop stepping, let a pass under way finish, then end the oracle processes."""
        self.closed = True
        if self.stepping is not None:
            await self.stepping
        for host in self.hosts.values():
            await host.close()
        self.hosts.clear()


def best_epoch_metrics(
    epochs: list[dict[str, Any]], study: StudyRecord
) -> tuple[dict[str, float], int | None, str | None]:
    """The trial's metrics at its best epoch by the study's first objective, and that epoch; or why there are
    none."""
    history = JobPicture().apply_all(epochs).history_dict()
    objective = OracleSpec.model_validate(study.spec["oracle"]).objective[0]
    values = history.get(objective.name) or []
    if not values:
        return (
            {},
            None,
            f"the trial reported no {objective.name!r} (its metrics: {sorted(history)}): check the objective",
        )
    pick = min if objective.direction == "min" else max
    best = pick(range(len(values)), key=lambda i: values[i])
    metrics = {k: float(vals[best]) for k, vals in history.items() if best < len(vals) and vals[best] is not None}
    return metrics, best, None
