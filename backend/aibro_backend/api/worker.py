"""The worker API: a per-instance token reaches only the job assigned to that instance."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import ValidationError

from aibro_core import vocabulary as v
from aibro_core.bounds import MAX_EPOCHS
from aibro_core.jobpicture import JobPicture
from aibro_core.models import INT64_MAX, WorkerEnroll, WorkerEvents, WorkerFinish, explain

from ..storage.events import NewEvent, NoSuchJob
from ..storage.records import SPEC_DUMP, InstanceRecord, JobRecord
from ..tuning.handover import handover_hold_s
from ..worker import version
from .base import ApiError, BaseHandler
from .workerbatch import read_fast

SEEN_TOUCH_S = 5.0  # an instance's last_seen is written at most this often: a busy worker's posts cost no write


class WorkerHandler(BaseHandler):
    instance: InstanceRecord

    def prepare(self) -> None:
        # looked up by the request guard (server/guard.header_refusal), else here
        inst = getattr(self.request, "aibro_instance", None) or self.backend.store.instances.for_token(self.bearer())
        if inst is None:
            raise ApiError(401, "unknown worker token")
        self.instance = inst
        now = time.time()
        if (inst.last_seen or 0) < now - SEEN_TOUCH_S:
            self.backend.store.instances.update(inst.id, last_seen=now)

    def assigned_job(self, job_id: str, attempt: int | None = None) -> JobRecord:
        """The job only if it is this instance's current assignment (and attempt, when given)."""
        inst = self.backend.store.instances.get(self.instance.id)  # fresh: an upload calls this again after awaits
        job = self.backend.store.jobs.get(job_id)
        if job is None or inst.job_id != job_id or job.instance_id != inst.id:
            raise ApiError(409, f"{job_id} is not assigned to {inst.id}: drop it")
        if attempt is not None and attempt != job.attempt:
            raise ApiError(409, f"attempt {attempt} of {job_id} is stale: drop it")
        return job


class EnrollHandler(BaseHandler):
    """A cloud machine's first call: its one-time enrollment token (user data, readable by anyone on the machine)
    buys the per-instance worker token, answered this once; the enrollment token is burnt, and refused once used
    or expired. Takes the token as `Authorization: Bearer` or as {"enroll_token"} in the body."""

    def post(self) -> None:
        body = self.body_model(WorkerEnroll, "the enrollment request")
        auth = self.request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        token = token or body.enroll_token or ""
        if not token:
            raise ApiError(401, "enrollment needs the one-time token: 'Authorization: Bearer TOKEN' or {enroll_token}")
        inst, answer = self.backend.store.instances.enroll(token)
        if inst is None:
            raise ApiError(401, answer)
        self.send({"instance_id": inst.id, "token": answer})


class AssignmentHandler(WorkerHandler):
    def get(self) -> None:
        store = self.backend.store
        inst = store.instances.get(self.instance.id)
        if inst.status in (v.CLOSING, v.CLOSED):
            self.send({"action": "exit"})
            return
        job = store.jobs.get(inst.job_id) if inst.job_id else None
        if job is None or job.status not in v.JOB_ACTIVE:
            self.send({"action": "wait", "cooling_until": inst.cooling_until})
            return
        reported, expected = self.request.headers.get(version.HEADER, ""), version.agent_version()
        if reported != expected:
            self.backend.scheduler.refuse_agent(inst, reported or "of an unknown version", expected)
            self.send({"action": "exit"})
            return
        if inst.status == v.LAUNCHING:
            store.instances.set_state(inst.id, v.EXECUTING, "", job_id=job.id)
        resume = None
        if job.epochs_done > 0:
            resume = {"epoch": job.epochs_done, "checkpoint": v.checkpoint_name(job.epochs_done - 1)}
        self.send(
            {
                "action": "train",
                "job_id": job.id,
                "attempt": job.attempt,
                "spec": job.checked_spec.model_dump(mode="json", **SPEC_DUMP),
                "resume": resume,
                "cancel": job.cancel_requested,
            }
        )


class WorkerEventsHandler(WorkerHandler):
    async def post(self, job_id: str) -> None:
        """Store a worker's events, each checked like user input (models.WorkerEvent). A bad event refuses the
        whole batch with 400 naming its `wseq`; the worker's outbox drops that event and sends the rest again.
        The answer waits for the group commit (groupcommit.py): an acknowledged event is on disk."""
        raw = self.body_json()
        fast = read_fast(raw)  # the plain batch and epoch events a worker sends all the time, without pydantic
        if fast is not None:
            attempt, events = fast
        else:
            try:
                body = WorkerEvents.model_validate(raw)
            except ValidationError as exc:
                loc = exc.errors()[0].get("loc", ())
                bad = _wseq_at(raw, loc)
                extra = {"wseq": bad} if bad is not None else {}
                raise ApiError(400, explain(exc, "the event batch"), **extra) from None
            attempt, events = body.attempt, [NewEvent(ev.type, ev.payload(), ev.wseq, ev.ts) for ev in body.events]
        job = self.assigned_job(job_id, attempt)
        spec = job.checked_spec
        epochs = spec.fit.epochs
        if spec.trial is not None and spec.trial.fit_args is not None:
            epochs = MAX_EPOCHS  # a HyperModel's own fit chooses the trial's epochs (hp may, as locally)
        for ev in events:
            if ev.type == v.EV_EPOCH and ev.data["epoch"] >= epochs:
                raise ApiError(400, f"epoch {ev.data['epoch']} is past the job's {epochs} epochs", wseq=ev.wseq)
        batch = [ev if ev.ts else ev._replace(ts=time.time()) for ev in events]
        try:
            stored = await self.backend.group_commit.append(job_id, batch, attempt)
        except NoSuchJob:  # deleted while the batch waited for its group
            raise ApiError(409, f"{job_id} is not assigned to {self.instance.id}: drop it") from None
        for event in stored:
            self.backend.scheduler.on_event(event)
        # the cancel flag as the job was read above: a cancel asked meanwhile reaches the worker with its next batch
        self.send({"acked": self.backend.store.events.max_wseq(job_id, attempt), "cancel": job.cancel_requested})


def _wseq_at(raw: dict[str, Any], loc: tuple[Any, ...]) -> int | None:
    """The wseq of the event a validation error points at, when it has a usable one."""
    if len(loc) < 2 or loc[0] != "events" or not isinstance(loc[1], int):
        return None
    events = raw.get("events")
    ev = events[loc[1]] if isinstance(events, list) and loc[1] < len(events) else None
    wseq = ev.get("wseq") if isinstance(ev, dict) else None
    return wseq if isinstance(wseq, int) and not isinstance(wseq, bool) and 0 < wseq <= INT64_MAX else None


class WorkerFinishHandler(WorkerHandler):
    def post(self, job_id: str) -> None:
        body = self.body_model(WorkerFinish, "the finish report")
        job = self.assigned_job(job_id, body.attempt)
        store, scheduler = self.backend.store, self.backend.scheduler
        outcome = body.outcome
        if outcome == v.SPOT_INTERRUPTED:
            scheduler.spot_interrupted(job, store.instances.get(self.instance.id), (body.error or "")[:1000])
            self.send({"ok": True})
            return
        if job.status in v.JOB_ACTIVE:
            if outcome == v.OUTCOME_COMPLETED:
                history = build_history(store.events.typed(job_id, (v.EV_EPOCH,)))
                size, sha = self.backend.blobs.write_artifact(job_id, "history.json", json.dumps(history).encode())
                store.artifacts.add(job_id, "history.json", size, sha)
                for art in store.artifacts.of_job(job_id):
                    if not art["name"].startswith(("checkpoints/", "tensorboard/", "envs/")):
                        scheduler.emit(job_id, v.EV_ARTIFACT, {"name": art["name"], "size": art["size"]})
                scheduler.set_status(job_id, v.COMPLETED, v.SUB_COMPLETED, "completed")
            elif outcome == v.OUTCOME_CANCELED:
                scheduler.set_status(job_id, v.CANCELED, v.SUB_CANCELED, "canceled")
            else:
                scheduler.fail(job_id, (body.error or "the worker failed without saying why")[:4000])
        # a running study's next trial is admitted as this job's end is published: it finds this worker warm
        scheduler.release_instance(store.instances.get(self.instance.id), hold_s=handover_hold_s(store, job))
        self.send({"ok": True})


def build_history(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Keras-style history (history.json) from the epoch events of every attempt: one entry per epoch, in order."""
    return JobPicture().apply_all(events).keras_history()
