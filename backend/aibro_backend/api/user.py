"""The user API: machines, blobs, jobs, events, artifacts, instances."""

from __future__ import annotations

import secrets
import time
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture
from aibro_core.models import CallbackFiles, CodeListing, Instance, Job, JobSpec, ReplayOverrides

from ..scheduling.costs import instance_cost, job_costs
from ..server.state import Backend
from ..storage.records import InstanceRecord, JobRecord
from ..storage.store import Store
from . import longpoll
from .base import ApiError, UserHandler
from .jobspec import validate_spec
from .transfer import quota

PLACEMENT_KEYS = ("state", "node_id", "node_ip", "hostname", "gpu_ids", "waiting", "ray_address")


_UNREADABLE = JobSpec.model_construct(machines=[])  # what job_view shows of a spec this version refuses (records.py)


def job_view(
    job: JobRecord,
    store: Store,
    costs: dict[str, float] | None = None,
    trials: dict[str, tuple[str, str]] | None = None,
) -> Job:
    """What a client sees of a job: states, progress, timeline and cost, never other users' data.

    Built by the one event reduction (aibro_core.jobpicture), which skips an event it cannot use, and read from
    the stored spec defensively: a row stored before requests were validated never turns this into a 500.
    `costs` (job id → USD, from job_costs) and `trials` (from trial_of_jobs) save a listing from reading the user's
    instances and trials once per job."""
    if costs is None:
        costs = job_costs(store.instances.list(job.user_id), time.time())
    if trials is None:
        trials = store.studies.trial_of_jobs(job.user_id, job.id)
    study_id, trial_id = trials.get(job.id, (None, None))
    spec = job.spec or _UNREADABLE
    picture = JobPicture().apply_all(store.events.typed(job.id, (v.EV_STATUS, v.EV_EPOCH, v.EV_ERROR)))
    valid = job.status is not None and job.substatus is not None
    return Job(
        job_id=job.id,
        status=job.status if valid else picture.status,
        substatus=job.substatus if valid else picture.substatus,
        description=str(job.description or ""),
        machine_id=job.machine_id,
        instance_id=job.instance_id,
        machines=spec.machines,
        cool_down_s=spec.cool_down_s,
        wait_request_s=spec.wait_request_s or 0.0,
        epochs=spec.fit.epochs,
        epochs_done=job.epochs_done,
        attempt=job.attempt,
        created=job.created,
        updated=job.updated,
        cancel_requested=job.cancel_requested,
        replay_of=job.replay_of,
        record=spec.record,
        meta=spec.meta or {},
        code=[CodeListing(**f.model_dump()) for f in spec.code.files] if spec.code else [],
        requirements=spec.requirements or [],
        files=callback_files(spec),
        cost=costs.get(job.id, 0.0),
        timeline=picture.timeline,
        history=picture.history_rows(),
        error=picture.error,
        study_id=study_id,
        trial_id=trial_id,
        workers=spec.workers,
    )


def instance_view(inst: InstanceRecord, now: float, placement: dict[str, Any] | None = None) -> Instance:
    """What a client sees of an instance: its states and their history, what it costs so far, where it runs."""
    priced = instance_cost(inst, now)
    cooling = inst.status == v.COOLING
    shown = {name: getattr(inst, name) for name in InstanceRecord.__slots__ if name != "pid"}
    return Instance(
        **shown,
        cooling_left_s=max(0.0, (inst.cooling_until or now) - now) if cooling else 0.0,
        cost=priced.cost,
        cooling_cost=priced.cooling_cost,
        billed_s=priced.billed_s,
        placement=placement,
    )


def callback_files(spec: JobSpec) -> list[CallbackFiles]:
    """The callback arguments that name a file or folder, and the kernel-side path each stands for; and the job's
    working directory, which stands for the kernel's."""
    out = []
    for i, cb in enumerate(spec.callbacks):
        config = cb.config if isinstance(cb.config, dict) else {}  # a checked config (EarlyStopping's) names no file
        for arg, value in config.items():
            if (
                isinstance(value, dict)
                and value.get("__path__") in ("file", "dir")
                and isinstance(value.get("kernel"), str)
            ):
                out.append(CallbackFiles(slot=f"{i}/{arg}", kind=value["__path__"], kernel=value["kernel"]))
    if spec.cwd is not None:
        out.append(CallbackFiles(slot=v.CWD_SLOT, kind="dir", kernel=spec.cwd))
    return out


class HealthHandler(UserHandler):
    def get(self) -> None:
        from .. import __version__
        from ..scheduling.jobmemory import JobMemory

        health = {"ok": True, "user": self.user["name"], "version": __version__, "quota": quota(self.backend, self.uid)}
        health["sandbox"] = self.backend.sandbox
        memory = JobMemory.of(self.backend.policy, self.backend.store, self.backend.scheduler.providers)
        health["job_memory"] = memory.view()  # what each job may hold (`aibro backend status` shows it)
        if self.backend.sandbox_warning:
            health["sandbox_warning"] = self.backend.sandbox_warning
        spare = next(filter(None, (p.spare_of(self.uid) for p in self.backend.scheduler.providers.values())), None)
        if spare:
            health["spare"] = spare  # a worker with TensorFlow loaded, waiting for this user's next job there
        if self.backend.events_port:
            health["events_port"] = self.backend.events_port  # long-polls answered cheaper there (eventport.py)
        self.send(health)


class MachinesHandler(UserHandler):
    def get(self) -> None:
        offers = self.backend.scheduler.machine_index().values()
        self.send({"machines": [offer.model_dump(exclude_unset=True) for _, offer in offers]})  # as providers set them


class PolicyHandler(UserHandler):
    def get(self) -> None:
        self.send(self.backend.policy.as_dict())


class StatsHandler(UserHandler):
    def get(self) -> None:
        self.send({"counters": self.backend.store.users.counters(self.uid)})


class JobsHandler(UserHandler):
    def get(self) -> None:
        store = self.backend.store
        cursor = store.events.max_gid(self.uid)  # taken first: events after it reach a watcher that follows from here
        costs = job_costs(store.instances.list(self.uid), time.time())
        trials = store.studies.trial_of_jobs(self.uid)
        jobs = [job_view(j, store, costs, trials).model_dump(mode="json") for j in store.jobs.list(self.uid)]
        self.send({"jobs": jobs, "cursor": cursor})

    def post(self) -> None:
        spec = self.body_json()
        self.send(submit_job(self, spec).model_dump(mode="json"), 201)


def submit_job(handler: UserHandler, raw: dict[str, Any] | JobSpec, replay_of: str | None = None) -> Job:
    job_id = admit_job(handler.backend, handler.uid, handler.user["name"], raw, replay_of)
    return job_view(handler.backend.store.jobs.get(job_id), handler.backend.store)


def admit_job(
    backend: Backend, uid: int, user_name: str, raw: dict[str, Any] | JobSpec, replay_of: str | None = None
) -> str:
    """Validate a job spec against the backend's machines and this user's limits, store and queue it; its id. A
    submitted job and a study's trial (tuning/studies.py) are admitted alike."""
    spec = check_job(backend, uid, user_name, raw)
    active = backend.store.jobs.list(uid, v.JOB_ACTIVE)
    if len(active) >= backend.policy.max_active_jobs:
        raise ApiError(
            429,
            f"{len(active)} jobs are active, the limit is {backend.policy.max_active_jobs}: "
            "wait for one to end, cancel one (`aibro cancel JOB`), or let the new job wait for a slot "
            "(%%cloud_fit --wait-slot S, wait_new_job_create_s=S)",
        )
    job_id = "job-" + time.strftime("%Y%m%d-") + secrets.token_hex(4)
    backend.store.jobs.create(job_id, uid, spec, replay_of=replay_of)
    backend.store.blobs.touch(uid, sorted(set(spec.blobs())))  # used now: the last to make room
    backend.scheduler.set_status(job_id, v.QUEUING, v.REQUESTING_SERVER, "queued")
    backend.scheduler.tick()
    return job_id


def check_job(backend: Backend, uid: int, user_name: str, raw: dict[str, Any] | JobSpec) -> JobSpec:
    """The validated spec, once it fits the machines, the backend's policy and the user's blobs: what a job must
    pass whenever it comes (a study's trials are checked so before the study starts)."""
    spec = validate_spec(raw, backend.scheduler.machine_index())
    if not spec.safe_mode and not backend.policy.unsafe_allowed(user_name):
        raise ApiError(
            403,
            f"this backend's policy does not let user {user_name!r} load models with safe_mode=False "
            "(Lambda layers run their Python code on the worker): replace the Lambda layers with registered custom "
            "layers, or ask the backend's admin to allow it (AIBRO_ALLOW_UNSAFE=all or a list of users)",
        )
    if spec.cool_down_s > backend.policy.max_cool_down_s:
        raise ApiError(
            400,
            f"cool_down_s={spec.cool_down_s:g} is over this backend's cap of {backend.policy.max_cool_down_s:g} s "
            "(a warm machine is held at most that long): ask for less (--cool-down / cool_down_period_s)",
        )
    total = 0
    for sha in set(spec.blobs()):
        size = backend.store.blobs.size(sha, uid)
        if size is None:
            raise ApiError(400, f"blob {sha} was not uploaded by this user: PUT /blobs/{sha} first")
        total += size
    if total > backend.policy.max_job_bytes:
        raise ApiError(413, f"this job's data is {total} bytes, over the {backend.policy.max_job_bytes}-byte limit")
    return spec


class JobHandler(UserHandler):
    def get(self, job_id: str) -> None:
        self.send(job_view(self.own_job(job_id), self.backend.store).model_dump(mode="json"))


class CancelHandler(UserHandler):
    def post(self, job_id: str) -> None:
        job = self.own_job(job_id)
        if job.status in v.JOB_ACTIVE and not job.cancel_requested:
            self.backend.store.jobs.update(job_id, cancel_requested=1)
            self.backend.scheduler.emit(job_id, v.EV_LOG, {"message": "cancel requested"})
            self.backend.scheduler.tick()
        self.send(job_view(self.backend.store.jobs.get(job_id), self.backend.store).model_dump(mode="json"))


class ReplayHandler(UserHandler):
    def post(self, job_id: str) -> None:
        job = self.own_job(job_id)
        if job.spec is None:
            raise ApiError(409, f"job {job_id} was stored in a shape this backend no longer accepts: submit it again")
        if not job.spec.record:
            raise ApiError(409, f"job {job_id} was not recorded (record=False), so it cannot be replayed")
        overrides = self.body_model(ReplayOverrides, "the replay overrides")
        spec = job.spec.model_copy(update=overrides.model_dump(exclude_none=True))
        self.send(submit_job(self, spec, replay_of=job_id).model_dump(mode="json"), 201)


class JobEventsHandler(UserHandler):
    async def get(self, job_id: str) -> None:
        after, wait = query_after_wait(self)
        self.finish(await longpoll.job_events(self.backend, self.uid, job_id, after, wait))


class UserEventsHandler(UserHandler):
    async def get(self) -> None:
        after, wait = query_after_wait(self)
        self.finish(await longpoll.user_events(self.backend, self.uid, after, wait))


def query_after_wait(handler: UserHandler) -> tuple[int, float]:
    args = handler.request.arguments
    return longpoll.after_wait({name: handler.get_query_argument(name) for name in ("after", "wait") if name in args})


class ArtifactsHandler(UserHandler):
    def get(self, job_id: str) -> None:
        self.own_job(job_id)
        self.send({"artifacts": self.backend.store.artifacts.of_job(job_id)})


class InstancesHandler(UserHandler):
    def get(self) -> None:
        now = time.time()
        views = [instance_view(i, now, self._placement(i)) for i in self.backend.store.instances.list(self.uid)]
        self.send({"instances": [view.model_dump(mode="json") for view in views]})

    def _placement(self, inst: InstanceRecord) -> dict[str, Any] | None:
        """Where a live instance runs, from a provider that says (a Ray node); None otherwise."""
        provider = self.backend.scheduler.providers.get(inst.provider)
        if provider is None or inst.status not in v.INSTANCE_LIVE:
            return None
        found = provider.info(inst)
        return {k: found.get(k) for k in PLACEMENT_KEYS if found.get(k) is not None}


class TerminateHandler(UserHandler):
    def post(self, instance_id: str) -> None:
        inst = self.backend.store.instances.get(instance_id, self.uid)
        if inst is None:
            raise ApiError(404, f"no instance '{instance_id[:80]}' for this user (GET /instances lists them)")
        if inst.status == v.EXECUTING:
            raise ApiError(409, f"{instance_id} is running job {inst.job_id}: cancel the job first")
        self.backend.scheduler.terminate_instance(inst)
        view = instance_view(self.backend.store.instances.get(instance_id, self.uid), time.time())
        self.send({"instance": view.model_dump(mode="json")})
