"""Hyperparameter studies (issue 27): each trial KerasTuner's oracle hands out runs as a job of the study's user,
at most `parallel` at once, and each job's end is reported back to the oracle, until it stops handing out.

The driver is the backend's, not the kernel's: a study goes on with the kernel and the browser gone, and after a
backend restart (the oracle's state and the trial→job table are both on disk). One slot per trial allowed to run at
once is KerasTuner's `tuner_id`; a trial that fails is recorded with its error and the study goes on as KerasTuner's
own search does (an error is an INVALID trial, retried `max_retries_per_trial` times; a FailedTrialError fails it at
once; `max_consecutive_failed_trials` failures in a row stop the study); cancelling a study cancels its running jobs.

The driver follows events, not a clock (issue 40): it steps when a job of a user with a running study ends (that
job's final status event, as the event bus publishes it), when a study starts or ends, and once at start-up; what
it does goes into the study's own event log (`study` events: a trial started, a trial ended with its score, the
study ended), which the kernel's follower and the sidebar long-poll as they do a job's. A trial's machine is kept
warm for its study's next trial (handover.py), which the driver admits as the previous one's job ends.

With `executions_per_trial` N (issue 35), a trial is N fits of freshly built models, as KerasTuner's run_trial
makes them: one job each, one after another in the trial's slot (so `parallel` still bounds the jobs at once, and
each job keeps one fit's event log and History); the trial's metrics are each execution's metrics at its best
epoch, averaged, and its step the mean of their best epochs, as KerasTuner's tuner_utils computes them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture
from aibro_core.models import (
    JobSpec,
    Objective,
    Study,
    StudyEventData,
    StudyTrial,
    TrialCheckpoint,
    TrialExecution,
)

from ..api.base import ApiError
from ..api.user import admit_job
from ..scheduling.costs import job_costs
from ..server.state import Backend
from ..storage.records import ExecutionRecord, JobRecord, StudyRecord, TrialRecord
from .handover import release_held
from .oracle_client import OracleHost, OracleUnavailable
from .oracle_host import OracleRequest

log = logging.getLogger(__name__)
MAX_STEP_FAILURES = 5  # a study whose step fails this many times in a row (not a refusal: a defect) ends FAILED
RETRY_STEP_S = 0.5  # a failed step is tried again after this, doubled each failure in a row


def study_dir(backend: Backend, study_id: str) -> Path:
    return backend.home / "state" / "studies" / study_id


def study_event(backend: Any, study_id: str, **fields: Any) -> None:
    """Append a `study` event (StudyEventData's fields) to the study's own log and wake whoever follows it, as a
    job's events are appended and published."""
    data = StudyEventData(**fields).model_dump(mode="json", exclude_none=True)
    event = backend.store.events.append(study_id, v.EV_STUDY, data)
    if event is not None:
        backend.bus.publish(event)


def create_study(backend: Backend, uid: int, raw: dict[str, Any], spec: Any) -> str:
    """Store a validated StudySpec (`spec`, from `raw`) and write its oracle's spec; the driver starts it."""
    study_id = "study-" + time.strftime("%Y%m%d-") + secrets.token_hex(4)
    OracleHost.create(study_dir(backend, study_id), spec.oracle)
    stored = {
        "oracle": spec.oracle.model_dump(),
        "job": raw["job"],
        "parallel": spec.parallel,
        "executions_per_trial": spec.executions_per_trial,
    }
    backend.store.studies.create(study_id, uid, stored, spec.description)
    if backend.study_driver is not None:
        backend.study_driver.wake()
    return study_id


def cancel_study(backend: Backend, study: StudyRecord) -> None:
    """The study stops handing out trials; its running trials' jobs are cancelled and the trials marked so."""
    if study.status != v.STUDY_RUNNING:
        return
    end_study(backend, study, v.STUDY_CANCELED, "cancelled")


def end_study(backend: Any, study: StudyRecord, status: v.StudyStatus, message: str | None) -> None:
    """The study ends `status`: a cancelled or failed one stops handing out trials, its running trials' jobs are
    cancelled and the trials marked so; the study's log says each trial's end, then the study's."""
    store = backend.store
    store.studies.update(study.id, status=status, message=message)  # first: nothing starts after this
    if status != v.STUDY_COMPLETED:
        for trial in store.studies.trials(study.id):
            if trial.status != v.TRIAL_RUNNING:
                continue
            job = store.jobs.get(trial.job_id)
            if job is not None and job.status in v.JOB_ACTIVE and not job.cancel_requested:
                store.jobs.update(job.id, cancel_requested=1)
                backend.scheduler.emit(job.id, v.EV_LOG, {"message": f"cancel requested (study {study.id} {status})"})
            why = "study cancelled" if status == v.STUDY_CANCELED else "study failed"
            store.studies.update_trial(study.id, trial.trial_id, status=v.TRIAL_CANCELED, message=why)
            study_event(
                backend,
                study.id,
                event=v.StudyEvent.TRIAL_ENDED,
                trial_id=trial.trial_id,
                job_id=trial.job_id,
                status=v.TRIAL_CANCELED,
                message=why,
            )
    study_event(
        backend,
        study.id,
        event=v.StudyEvent.STUDY_ENDED,
        status=status,
        message=message,
        best_trial_id=best_trial_id(store.studies.trials(study.id), study.spec.oracle.objective),
    )
    release_held(backend, study.user_id)
    if status != v.STUDY_COMPLETED:
        backend.scheduler.tick()
    log.info("study %s %s%s", study.id, status, f": {message}" if message else "")


def best_trial_id(trials: list[TrialRecord], objective: list[Objective]) -> str | None:
    """The completed trial with the best score by the objective (the first on a tie), or None."""
    sign = 1.0 if score_direction(objective) == "min" else -1.0
    scored = [t for t in trials if t.status == v.TRIAL_COMPLETED and t.score is not None]
    return min(scored, key=lambda t: sign * float(t.score or 0.0)).trial_id if scored else None


def _checkpoint_view(found: tuple[str, int | None] | None) -> TrialCheckpoint | None:
    return None if found is None else TrialCheckpoint(job_id=found[0], epoch=found[1])


def executions_per_trial(study: StudyRecord) -> int:
    return study.spec.executions_per_trial


def study_view(backend: Backend, study: StudyRecord) -> Study:
    trials = backend.store.studies.trials(study.id)
    executions = backend.store.studies.executions(study.id)
    oracle = study.spec.oracle
    best = best_trial_id(trials, oracle.objective)
    costs = job_costs(backend.store.instances.list(study.user_id), time.time())
    return Study(
        study_id=study.id,
        status=study.status,  # type: ignore[arg-type]
        description=study.description,
        message=study.message,
        kind=oracle.kind,
        objective=[o.model_dump() for o in oracle.objective],
        max_trials=oracle.max_trials,
        parallel=study.spec.parallel,
        executions_per_trial=executions_per_trial(study),
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
                executions=[
                    TrialExecution(
                        job_id=e.job_id,
                        status=e.status,  # type: ignore[arg-type]
                        metrics=e.metrics,
                        best_step=e.best_step,
                    )
                    for e in executions.get(t.trial_id, [])
                ],
                checkpoint=_checkpoint_view(trial_checkpoint(executions.get(t.trial_id, []), oracle.objective)),
                hyperparameters=t.hyperparameters,
            )
            for t in trials
        ],
        best_trial_id=best,
        cost=sum(
            costs.get(e.job_id, 0.0) for runs in backend.store.studies.executions(study.id, True).values() for e in runs
        ),
    )


class StudyDriver:
    """Steps every running study: reports ended trials, fills free slots, ends the study when the oracle stops.
    It steps when woken (`wake`): by `on_event` for a job's end or a study's, by a study's start, and once when it
    starts; never on a timer, except to try a failed step again."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.hosts: dict[str, OracleHost] = {}
        self.failures: dict[str, int] = {}
        self.stepping: asyncio.Future[None] | None = None
        self.closed = False
        self.users: set[int] = set()  # the users with a running study: their jobs' ends wake the driver
        self._woken: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Follow the event bus and step at once (studies the backend was driving before it stopped go on)."""
        self._woken = asyncio.Event()
        self.backend.bus.listeners.append(self.on_event)
        self._loop_task = asyncio.get_running_loop().create_task(self._follow())
        self.wake()

    def wake(self) -> None:
        """Step as soon as the pass under way (if any) is done."""
        if self._woken is not None:
            self._woken.set()

    def on_event(self, event: dict[str, Any]) -> None:
        """A stored event, as the bus publishes it: a job of a user with a running study ended (a trial to report,
        or a slot a job limit held), or a study ended (its oracle to close)."""
        kind, data = event.get("type"), event.get("data") or {}
        if kind == v.EV_STATUS and data.get("status") in v.JOB_FINAL and event.get("user_id") in self.users:
            self.wake()
        elif kind == v.EV_STUDY and data.get("event") == v.StudyEvent.STUDY_ENDED:
            self.wake()

    async def _follow(self) -> None:
        assert self._woken is not None
        while not self.closed:
            await self._woken.wait()
            self._woken.clear()
            await self.step()

    async def step(self) -> None:
        """One pass over the running studies (never two at once: a slow oracle makes the next pass wait; none once
        the driver is closed, when the store may already be)."""
        if self.stepping is not None or self.closed:
            return
        self.stepping = asyncio.get_running_loop().create_future()
        try:
            running = self.backend.store.studies.list(statuses=(v.STUDY_RUNNING,))
            self.users = {study.user_id for study in running}
            for study in running:
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
                        self._retry_later(self.failures[study.id])
                else:
                    self.failures.pop(study.id, None)
            for study_id in [s for s in self.hosts if self._final(s)]:
                await self.hosts.pop(study_id).close()
        finally:
            self.stepping.set_result(None)
            self.stepping = None

    def _retry_later(self, failures: int) -> None:
        """A step that failed (a defect, not a refusal) is tried again after a backoff, not at the next event."""
        if self._retry is None and self._woken is not None:

            def again() -> None:
                self._retry = None
                self.wake()

            delay = RETRY_STEP_S * 2 ** (failures - 1)
            self._retry = asyncio.get_running_loop().call_later(delay, again)

    def _final(self, study_id: str) -> bool:
        study = self.backend.store.studies.get(study_id)
        return study is None or study.status != v.STUDY_RUNNING

    def host(self, study: StudyRecord) -> OracleHost:
        if study.id not in self.hosts:
            store = self.backend.store

            def running() -> dict[str, str]:
                return {t.trial_id: t.slot for t in store.studies.trials(study.id) if t.status == v.TRIAL_RUNNING}

            self.hosts[study.id] = OracleHost(study_dir(self.backend, study.id), running)
        return self.hosts[study.id]

    async def _drive(self, study: StudyRecord) -> None:
        store = self.backend.store
        host = self.host(study)
        for trial in store.studies.trials(study.id):
            job = store.jobs.get(trial.job_id) if trial.status == v.TRIAL_RUNNING else None
            if job is not None and job.status in v.JOB_FINAL:
                await self._report(study, host, trial, job)
                if self._final(study.id):
                    return
        busy = {t.slot for t in store.studies.trials(study.id) if t.status == v.TRIAL_RUNNING}
        stopped = 0
        for n in range(study.spec.parallel):
            slot = f"slot-{n}"
            if slot in busy:
                continue
            asked = time.perf_counter()
            got = await host.ask(OracleRequest(op="create_trial", slot=slot))
            if not got.ok or got.trial is None:
                raise OracleUnavailable(got.error or "the oracle answered no trial")
            if got.stopped:
                stopped += 1
            elif got.trial.status == v.TunerTrialStatus.RUNNING:
                oracle_s = time.perf_counter() - asked
                self._start_trial(study, slot, got.trial.trial_id, got.trial.values, oracle_s)
        if stopped == study.spec.parallel and not busy:
            self._end_study(study, v.STUDY_COMPLETED, None)

    def _start_trial(
        self, study: StudyRecord, slot: str, trial_id: str, values: dict[str, Any], oracle_s: float
    ) -> None:
        """The trial as a job of the study's user (its first execution); a job the backend refuses for a limit waits
        for the next step (the oracle hands the same trial to the slot again), one it refuses outright ends the
        study."""
        if self._final(study.id):  # cancelled while the oracle answered: nothing starts after a cancel
            return
        job_id = self._admit(study, trial_id, self._trial_job(study, trial_id, values, 0))
        if job_id is None:
            return
        self.backend.store.studies.add_trial(study.id, trial_id, slot, job_id, values)
        study_event(
            self.backend,
            study.id,
            event=v.StudyEvent.TRIAL_STARTED,
            trial_id=trial_id,
            job_id=job_id,
            execution=0,
            slot=slot,
            oracle_s=round(oracle_s, 4),
        )
        log.info("study %s: trial %s runs as %s (%s)", study.id, trial_id, job_id, slot)

    def _start_execution(self, study: StudyRecord, trial: TrialRecord, execution: int) -> None:
        """The trial's next execution, a fresh model fitted again with the same values, as its own job; refused
        for a limit, the next step (which finds the trial's last job ended again) tries again."""
        if self._final(study.id):
            return
        job_id = self._admit(study, trial.trial_id, self._trial_job(study, trial.trial_id, trial.values, execution))
        if job_id is None:
            return
        self.backend.store.studies.add_execution(study.id, trial.trial_id, execution, job_id)
        study_event(
            self.backend,
            study.id,
            event=v.StudyEvent.TRIAL_STARTED,
            trial_id=trial.trial_id,
            job_id=job_id,
            execution=execution,
            slot=trial.slot,
        )
        log.info("study %s: trial %s execution %d runs as %s", study.id, trial.trial_id, execution, job_id)

    def _trial_job(self, study: StudyRecord, trial_id: str, values: dict[str, Any], execution: int) -> JobSpec:
        """The job spec of one execution of a trial: the study's, with the trial's values (and Hyperband's round);
        admit_job validates it again, as it would a submitted job."""
        job = study.spec.job
        assert job.trial is not None  # StudySpec requires a trial build
        trial = {"values": values, "study_id": study.id, "trial_id": trial_id}
        fit = job.fit
        if "tuner/epochs" in values:  # Hyperband's round: these epochs, from where the earlier trial stopped
            round_ = {"epochs": int(values["tuner/epochs"]), "initial_epoch": int(values.get("tuner/initial_epoch", 0))}
            fit = fit.model_copy(update=round_)
            if job.trial.fit_args is not None:  # KerasTuner's Hyperband puts both in what fit is given
                trial["fit_args"] = sorted({*job.trial.fit_args, "epochs", "initial_epoch"})
        earlier = values.get("tuner/trial_id")  # Hyperband: start from that trial's best checkpoint
        if earlier is not None:
            checkpoint = self._checkpoint(study, str(earlier))
            if checkpoint is not None:
                trial["resume_job"], trial["resume_epoch"] = checkpoint
        n = executions_per_trial(study)
        of = f" · execution {execution + 1} of {n}" if n > 1 else ""
        description = f"{study.description or study.id} · trial {trial_id}{of}"
        return job.model_copy(
            update={"trial": job.trial.model_copy(update=trial), "fit": fit, "description": description}
        )

    def _checkpoint(self, study: StudyRecord, trial_id: str) -> tuple[str, int | None] | None:
        """The job and epoch whose weights are the trial's checkpoint, as KerasTuner's SaveBestEpoch keeps one per
        trial: the epoch with the best objective of all its executions (the first such); None for a trial that
        never ran."""
        runs = self.backend.store.studies.executions(study.id).get(trial_id, [])
        objective = study.spec.oracle.objective
        return trial_checkpoint(runs, objective)

    def _admit(self, study: StudyRecord, trial_id: str, job: JobSpec) -> str | None:
        user = self.backend.store.users.name_of(study.user_id) or ""
        try:
            return admit_job(self.backend, study.user_id, user, job)
        except ApiError as exc:
            if exc.status != 429:  # refused outright (the policy changed since the study began): every trial would be
                self._end_study(study, v.STUDY_FAILED, f"trial {trial_id}'s job was refused: {exc}")
            return None

    async def _report(self, study: StudyRecord, host: OracleHost, trial: TrialRecord, job: JobRecord) -> None:
        """Record how the trial's latest execution ended; start its next one, or tell the oracle how the trial
        ended: its executions' metrics at their best epochs averaged (as KerasTuner reports its Histories), or the
        error that ended it (an INVALID trial, which the oracle retries as it would locally; a FailedTrialError
        FAILED at once)."""
        store = self.backend.store
        ran = execution_result(store, study, job)
        store.studies.update_execution(job.id, ran.row_status, ran.metrics, ran.best_step, ran.best_epoch)
        runs = store.studies.executions(study.id).get(trial.trial_id, [])
        wanted = executions_per_trial(study)
        if ran.status == v.TunerTrialStatus.COMPLETED and len(runs) < wanted:
            self._start_execution(study, trial, len(runs))
            return
        if ran.status == v.TunerTrialStatus.COMPLETED:
            done = [e for e in runs if e.status == v.TRIAL_COMPLETED]
            metrics, best_step, message = average_metrics([e.metrics for e in done]), mean_step(done), None
        else:
            metrics, best_step = {}, None
            message = f"execution {len(runs)} of {wanted}: {ran.message}" if wanted > 1 else ran.message
        asked = time.perf_counter()
        got = await host.ask(
            OracleRequest(
                op="end_trial",
                trial_id=trial.trial_id,
                status=ran.status,
                metrics=metrics,
                step=best_step or 0,
                message=message,
                hyperparameters=ran.hyperparameters,
            )
        )
        ended = got.trial
        completed = ended is not None and ended.status == v.TunerTrialStatus.COMPLETED and ended.score is not None
        fields: dict[str, Any] = {
            "status": v.TRIAL_COMPLETED if completed else v.TRIAL_FAILED,
            "score": ended.score if ended else None,
            "message": None if completed else (message or (ended.message if ended else None)),
            "metrics": json.dumps(metrics),
            "best_step": best_step,
        }
        if ended is not None:
            fields.update(trial_values=json.dumps(ended.values), hyperparameters=json.dumps(ended.hyperparameters))
        oracle_s = time.perf_counter() - asked
        store.studies.update_trial(study.id, trial.trial_id, **fields)
        if self._final(study.id):  # cancelled while the oracle answered: its log already ended with the study
            return
        study_event(
            self.backend,
            study.id,
            event=v.StudyEvent.TRIAL_ENDED,
            trial_id=trial.trial_id,
            job_id=job.id,
            status=fields["status"],
            score=fields["score"],
            message=fields["message"],
            best_trial_id=best_trial_id(store.studies.trials(study.id), study.spec.oracle.objective),
            oracle_s=round(oracle_s, 4),
        )
        if not got.ok and "already" not in (got.error or ""):
            self._end_study(study, v.STUDY_FAILED, got.error)

    def _end_study(self, study: StudyRecord, status: v.StudyStatus, message: str | None) -> None:
        if self._final(study.id):  # cancelled by its user while this step waited on the oracle
            return
        end_study(self.backend, study, status, message)

    async def close(self) -> None:
        """Stop stepping, let a pass under way finish, then end the oracle processes."""
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
        if self._woken is not None:
            self._woken.set()
            if self.on_event in self.backend.bus.listeners:
                self.backend.bus.listeners.remove(self.on_event)
        if self.stepping is not None:
            await self.stepping
        if self._loop_task is not None:
            await self._loop_task
        for host in self.hosts.values():
            await host.close()
        self.hosts.clear()


@dataclass
class ExecutionResult:
    """How one execution's job ended, as KerasTuner's run_trial would have seen its fit end."""

    status: v.TunerTrialStatus  # the oracle's: COMPLETED, INVALID (an error; retried as configured) or FAILED
    metrics: dict[str, float] = field(default_factory=dict)
    best_step: int | None = None  # the best epoch's index in the History
    best_epoch: int | None = None  # its number in the job (0-based), past a Hyperband round's initial_epoch
    message: str | None = None
    hyperparameters: dict[str, Any] | None = None

    @property
    def row_status(self) -> v.TrialStatus:
        return v.TRIAL_COMPLETED if self.status == v.TunerTrialStatus.COMPLETED else v.TRIAL_FAILED


def execution_result(store: Any, study: StudyRecord, job: JobRecord) -> ExecutionResult:
    """What the execution's job reported: its metrics at its best epoch (or what its HyperModel.fit returned),
    the trial's hyperparameters as its fit left them, or its error."""
    objective = study.spec.oracle.objective
    report = next(
        (e["data"]["trial"] for e in reversed(store.events.typed(job.id, (v.EV_LOG,))) if e["data"].get("trial")), {}
    )
    hp = report.get("hyperparameters")
    if job.status != v.COMPLETED:
        errors = store.events.typed(job.id, (v.EV_ERROR,))
        if not errors:
            return ExecutionResult(v.TunerTrialStatus.FAILED, message="the job was cancelled", hyperparameters=hp)
        message = str(errors[-1]["data"].get("message") or "the job failed")
        failed = message.startswith("FailedTrialError")  # KerasTuner's way to fail a trial without retries
        return ExecutionResult(
            v.TunerTrialStatus.FAILED if failed else v.TunerTrialStatus.INVALID, message=message, hyperparameters=hp
        )
    if report.get("metrics") is not None or "value" in report:  # HyperModel.fit returned a dict or a number
        returned = report.get("metrics")
        if returned is None:
            returned = {objective_name(objective): report.get("value")}
        metrics = {k: math.nan if val is None else float(val) for k, val in returned.items()}
        if objective_value(metrics, objective) is None:
            why = f"HyperModel.fit returned no {objective_name(objective)!r} (it returned {sorted(metrics)})"
            return ExecutionResult(v.TunerTrialStatus.FAILED, message=why, hyperparameters=hp)
        return ExecutionResult(v.TunerTrialStatus.COMPLETED, metrics, None, hyperparameters=hp)  # no epoch: step 0
    picture = JobPicture().apply_all(store.events.typed(job.id, (v.EV_EPOCH,)))
    metrics, best_step, why = best_epoch_metrics(picture.keras_lists(), objective)
    if why is not None or best_step is None:
        return ExecutionResult(v.TunerTrialStatus.FAILED, message=why, hyperparameters=hp)
    epochs = sorted(picture.epoch_logs())
    best_epoch = epochs[best_step] if best_step < len(epochs) else None
    return ExecutionResult(v.TunerTrialStatus.COMPLETED, metrics, best_step, best_epoch, hyperparameters=hp)


def objective_name(objective: list[Objective]) -> str:
    """KerasTuner's name of the objective: a MultiObjective's is 'multi_objective'."""
    return objective[0].name if len(objective) == 1 else "multi_objective"


def score_direction(objective: list[Objective]) -> str:
    """Which way the score is better: the objective's, or 'min' for a MultiObjective (its score is a sum)."""
    return objective[0].direction if len(objective) == 1 else "min"


def objective_value(metrics: dict[str, Any], objective: list[Objective]) -> float | None:
    """The objective's value in `metrics` as KerasTuner's Objective.get_value computes it (a MultiObjective's is
    the sum of its minimized metrics less its maximized ones); None when a metric it needs is missing."""
    if len(objective) == 1:
        value = metrics.get(objective[0].name)
        return None if value is None else float(value)
    if any(metrics.get(o.name) is None for o in objective):
        return None
    return sum(float(metrics[o.name]) * (1.0 if o.direction == "min" else -1.0) for o in objective)


def best_epoch_metrics(
    history: dict[str, list[float]], objective: list[Objective]
) -> tuple[dict[str, float], int | None, str | None]:
    """The metrics at the best epoch of a History (Keras' `history.history`) by the objective, the first best, and
    that epoch's index, as KerasTuner picks them (tuner_utils); or why there are none. A value that was not finite
    is left out."""
    rows: dict[int, dict[str, float]] = {}
    for name, values in history.items():
        for i, value in enumerate(values):
            if value is not None and math.isfinite(value):
                rows.setdefault(i, {})[name] = float(value)
    scored = [(i, objective_value(rows[i], objective)) for i in sorted(rows)]
    found = [(i, value) for i, value in scored if value is not None]
    if not found:
        names = [o.name for o in objective]
        named = names[0] if len(names) == 1 else names
        return {}, None, f"the trial reported no {named!r} (its metrics: {sorted(history)}): check the objective"
    better = (lambda a, b: a < b) if score_direction(objective) == "min" else (lambda a, b: a > b)
    best, best_value = found[0]
    for i, value in found[1:]:
        if better(value, best_value):
            best, best_value = i, value
    metrics = dict(rows[best])
    if len(objective) > 1:
        metrics["multi_objective"] = best_value  # as KerasTuner adds the objective's value to the epoch's metrics
    return metrics, best, None


def average_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the executions that reported it (KerasTuner's average_metrics_dicts)."""
    names = {name for run in runs for name in run}
    return {name: float(statistics.fmean(run[name] for run in runs if name in run)) for name in sorted(names)}


def mean_step(runs: list[ExecutionRecord]) -> int:
    """The trial's step: the mean of its executions' best epochs, truncated (KerasTuner's get_best_step)."""
    return int(statistics.mean(e.best_step or 0 for e in runs)) if runs else 0


def trial_checkpoint(runs: list[ExecutionRecord], objective: list[Objective]) -> tuple[str, int | None] | None:
    """(job, epoch) of a trial's checkpoint: its completed execution with the best objective at its best epoch,
    the first on a tie, as KerasTuner's one SaveBestEpoch per trial keeps the best epoch of all its executions.
    The epoch is None for an execution whose HyperModel.fit returned a value (its job's final model then)."""
    better = (lambda a, b: a < b) if score_direction(objective) == "min" else (lambda a, b: a > b)
    best: tuple[str, int | None] | None = None
    best_value: float | None = None
    for run in runs:
        value = objective_value(run.metrics, objective)
        if run.status != v.TRIAL_COMPLETED or value is None:
            continue
        if best_value is None or better(value, best_value):
            best, best_value = (run.job_id, run.best_epoch), value
    return best
