"""The worker API: a per-instance token reaches only the job assigned to that instance."""

from __future__ import annotations

import json
import time
from typing import Any

from aibro_core import vocabulary as v

from .base import ApiError, BaseHandler

WORKER_SUBSTATUSES = (v.GEARING_UP_ENV, v.SENDING_MODEL_DATA, v.SUB_TRAINING, v.RETURNING)


class WorkerHandler(BaseHandler):
    instance: dict[str, Any]

    def prepare(self) -> None:
        inst = self.backend.store.instance_for_token(self.bearer())
        if inst is None:
            raise ApiError(401, "unknown worker token")
        self.instance = inst
        self.backend.store.update_instance(inst["id"], last_seen=time.time())

    def assigned_job(self, job_id: str, attempt: int | None = None) -> dict[str, Any]:
        """The job only if it is this instance's current assignment (and attempt, when given)."""
        inst = self.backend.store.instance(self.instance["id"])
        job = self.backend.store.job(job_id)
        if job is None or inst["job_id"] != job_id or job["instance_id"] != inst["id"]:
            raise ApiError(409, f"{job_id} is not assigned to {inst['id']}: drop it")
        if attempt is not None and attempt != job["attempt"]:
            raise ApiError(409, f"attempt {attempt} of {job_id} is stale: drop it")
        return job


class AssignmentHandler(WorkerHandler):
    def get(self) -> None:
        store = self.backend.store
        inst = store.instance(self.instance["id"])
        if inst["status"] in (v.CLOSING, v.CLOSED):
            self.send({"action": "exit"})
            return
        job = store.job(inst["job_id"]) if inst["job_id"] else None
        if job is None or job["status"] not in v.JOB_ACTIVE:
            self.send({"action": "wait", "cooling_until": inst["cooling_until"]})
            return
        if inst["status"] == v.LAUNCHING:
            store.set_instance_state(inst["id"], v.EXECUTING, "", job_id=job["id"])
        resume = None
        if job["epochs_done"] > 0:
            resume = {"epoch": job["epochs_done"], "checkpoint": v.checkpoint_name(job["epochs_done"] - 1)}
        self.send(
            {
                "action": "train",
                "job_id": job["id"],
                "attempt": job["attempt"],
                "spec": job["spec"],
                "resume": resume,
                "cancel": job["cancel_requested"],
            }
        )


class WorkerEventsHandler(WorkerHandler):
    def post(self, job_id: str) -> None:
        body = self.body_json()
        attempt = int(body.get("attempt", -1))
        job = self.assigned_job(job_id, attempt)
        scheduler = self.backend.scheduler
        for ev in body.get("events", []):
            type_, data = ev.get("type"), ev.get("data") or {}
            if type_ not in v.WORKER_EVENT_TYPES or not isinstance(data, dict):
                raise ApiError(400, f"event type {type_!r} is not accepted from a worker")
            if type_ == v.EV_STATUS and data.get("substatus") not in WORKER_SUBSTATUSES:
                raise ApiError(400, f"a worker may not set substatus {data.get('substatus')!r}")
            if type_ == v.EV_STATUS and self.backend.store.job(job_id)["status"] not in v.JOB_ACTIVE:
                continue
            stored = self.backend.store.append_event(
                job_id, type_, data, attempt=attempt, wseq=int(ev["wseq"]), ts=float(ev.get("ts") or time.time())
            )
            if stored:
                scheduler.on_event(stored)
        job = self.backend.store.job(job_id)
        self.send({"acked": self.backend.store.max_wseq(job_id, attempt), "cancel": job["cancel_requested"]})


class WorkerFinishHandler(WorkerHandler):
    def post(self, job_id: str) -> None:
        body = self.body_json()
        attempt = int(body.get("attempt", -1))
        job = self.assigned_job(job_id, attempt)
        store, scheduler = self.backend.store, self.backend.scheduler
        outcome = body.get("outcome")
        if job["status"] in v.JOB_ACTIVE:
            if outcome == "completed":
                history = build_history(store.events(job_id))
                size, sha = self.backend.blobs.write_artifact(job_id, "history.json", json.dumps(history).encode())
                store.add_artifact(job_id, "history.json", size, sha)
                for art in store.artifacts(job_id):
                    if not art["name"].startswith(("checkpoints/", "tensorboard/")):
                        scheduler.emit(job_id, v.EV_ARTIFACT, {"name": art["name"], "size": art["size"]})
                scheduler.set_status(job_id, v.COMPLETED, v.SUB_COMPLETED, "completed")
            elif outcome == "canceled":
                scheduler.set_status(job_id, v.CANCELED, v.SUB_CANCELED, "canceled")
            else:
                scheduler.fail(job_id, str(body.get("error") or "the worker failed without saying why")[:4000])
        scheduler.release_instance(store.instance(self.instance["id"]))
        self.send({"ok": True})


def build_history(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Keras-style history from the epoch events of every attempt: one entry per epoch, in order."""
    by_epoch: dict[int, dict[str, Any]] = {}
    for ev in events:
        if ev["type"] == v.EV_EPOCH:
            by_epoch[int(ev["data"]["epoch"])] = ev["data"]["logs"]
    epochs = sorted(by_epoch)
    keys: list[str] = []
    for e in epochs:
        keys += [k for k in by_epoch[e] if k not in keys]
    return {"epoch": epochs, "history": {k: [by_epoch[e].get(k) for e in epochs] for k in keys}}
