"""Moves jobs through their states: assignment to cooling or new instances, worker loss and retry,
cancel deadlines and cool-down expiry. Runs as a periodic callback on the backend's IOLoop."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.files import new_token
from aibro_core.models import Machine

from ..providers.base import CapacityError, LaunchRequest, Provider
from ..providers.shipping import tensorflow_pin
from ..storage.records import InstanceRecord, JobRecord, unreadable_reason
from ..storage.store import Store
from .jobmemory import VARIABLE as MEMORY_VARIABLE
from .jobmemory import launch_limit
from .policy import Policy

log = logging.getLogger("aibro.scheduler")
MAX_SPOT_INTERRUPTIONS = 10  # reclaimed spot machines a job survives (counted apart from crashes)


class _Placement:
    """The instances one assignment pass looks at, read once for the pass instead of four times for each queued
    job (a team's queue of 30 jobs read and decoded every instance row ~500 times a second); `Scheduler._assign`
    says when it changed one, and the pass reads them again."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.store, self.scheduler = scheduler.store, scheduler
        self.read()

    def read(self) -> None:
        self.live = self.store.instances.list(statuses=v.INSTANCE_LIVE)  # oldest first, as each filter below keeps
        self.stopped = self.scheduler.stopped_instances()


class Scheduler:
    def __init__(
        self,
        store: Store,
        providers: dict[str, Provider],
        policy: Policy,
        worker_url: Callable[[], str],
        on_event: Callable[[dict[str, Any]], None],
    ) -> None:
        self.store = store
        self.providers = providers
        self.policy = policy
        self.worker_url = worker_url
        self.on_event = on_event
        self._waiting: dict[str, str] = {}  # job id → what it last said it waits for
        self._ops: dict[str, Future] = {}  # instance id → its provider's stop/start in flight (clouds)
        self._skip_stopped: set[str] = set()  # stopped instances that failed to start: never tried again
        self._unserved: set[str] = set()  # instances of a provider this backend does not run now (warned once)

    # -- helpers used by the API too --------------------------------------------------------------
    def machine_index(self) -> dict[str, tuple[str, Machine]]:
        """Every machine the providers offer now, by id, with its provider's name."""
        return {o.machine_id: (name, o) for name, p in self.providers.items() for o in p.offers()}

    def offer(self, machine_id: str) -> Machine | None:
        """The machine `machine_id` as its provider offers it now; None if none does."""
        found = self.machine_index().get(machine_id)
        return found[1] if found is not None else None

    def emit(self, job_id: str, type_: str, data: dict[str, Any]) -> None:
        ev = self.store.events.append(job_id, type_, data)
        if ev:
            self.on_event(ev)

    def set_status(self, job_id: str, status: str, substatus: str, message: str = "") -> None:
        data = {"status": status, "substatus": substatus}
        if message:
            data["message"] = message
        self.emit(job_id, v.EV_STATUS, data)

    def fail(self, job_id: str, message: str) -> None:
        """A failed job is CANCELED with an error event that says why."""
        self.emit(job_id, v.EV_ERROR, {"message": message})
        self.set_status(job_id, v.CANCELED, v.SUB_CANCELED, message)

    def release_instance(self, inst: InstanceRecord, cool: bool = True, hold_s: float = 0.0) -> None:
        """After a job: keep the instance warm for its cool-down (at least `hold_s`: a study's next trial comes), or
        close it."""
        warm_s = max(inst.cool_down_s, hold_s)
        if cool and warm_s > 0 and inst.status in (v.EXECUTING, v.LAUNCHING):
            self.store.instances.set_state(inst.id, v.COOLING, "", job_id=None, cooling_until=time.time() + warm_s)
        else:
            self.close_instance(inst)

    def close_instance(self, inst: InstanceRecord) -> None:
        """Close an instance: an on-demand machine of a provider that can stop it (a cloud) is stopped, kept for a
        fast restart, while its user holds fewer than `max_stopped_instances` stopped ones; others terminate."""
        if self._stoppable(inst):
            try:
                fut = self.providers[inst.provider].stop(inst)
            except Exception as exc:  # noqa: BLE001 - cannot stop: terminate instead
                log.warning("cannot stop %s (%s); terminating it", inst.id, exc)
            else:
                self._ops[inst.id] = fut
                self.store.instances.set_state(inst.id, v.CLOSING, v.STOPPING, job_id=None)
                return
        self.store.instances.set_state(inst.id, v.CLOSING, v.TERMINATING, job_id=None)

    def terminate_instance(self, inst: InstanceRecord) -> None:
        """A user's terminate: the machine goes for good, never stopped for later. A live one closes as any
        terminated instance does (its agent exits; the tick terminates it if it does not); a stopped one runs no
        agent, so its provider terminates it now."""
        if inst.status == v.CLOSED and inst.substatus == v.STOPPED:
            provider = self.providers.get(inst.provider)
            if provider is not None:
                provider.terminate(inst)
            self.store.instances.set_state(inst.id, v.CLOSED, v.TERMINATED, job_id=None)
        elif inst.status in v.INSTANCE_LIVE:
            self.store.instances.set_state(inst.id, v.CLOSING, v.TERMINATING, job_id=None)

    def _stoppable(self, inst: InstanceRecord) -> bool:
        provider = self.providers.get(inst.provider)
        if provider is None or not provider.can_stop:
            return False
        offer = self.offer(inst.machine_id)
        if offer is None or offer.spot:
            return False
        stopping = [i for i in self.store.instances.list(inst.user_id, (v.CLOSING,)) if i.substatus == v.STOPPING]
        return len(self.stopped_instances(inst.user_id)) + len(stopping) < self.policy.max_stopped_instances

    def stopped_instances(self, user_id: int | None = None) -> list[InstanceRecord]:
        """Stopped machines kept for a fast restart (CLOSED / STOPPED), oldest first."""
        return [i for i in self.store.instances.list(user_id, (v.CLOSED,)) if i.substatus == v.STOPPED]

    # -- providers whose machines outlive the backend (clouds) ------------------------------------------
    def adopt_all(self) -> list[Future]:
        """At start-up: each provider that can (`adopt()`) finds its live machines again (by tag); Futures."""
        return [fut for fut in (p.adopt() for p in self.providers.values()) if fut is not None]

    def reconcile_all(self) -> list[Future]:
        """Every few minutes: each provider that can (`reconcile(ids)`) ends machines the store does not know as
        live (or whose time is up), so nothing leaks money; Futures."""
        futures = []
        for name, provider in self.providers.items():
            live = self.store.instances.list(statuses=(*v.INSTANCE_LIVE, v.CLOSING)) + self.stopped_instances()
            fut = provider.reconcile([i.id for i in live if i.provider == name])
            if fut is not None:
                futures.append(fut)
        return futures

    # -- the periodic tick --------------------------------------------------------------------------
    def tick(self) -> None:
        try:
            for provider in self.providers.values():
                provider.reap()
            self._check_instances()
            self._check_cancels()
            self._assign_queued()
        except Exception:  # the loop must survive one bad row
            log.exception("scheduler tick failed")

    def _check_instances(self) -> None:
        now = time.time()
        for inst in self.store.instances.list(statuses=(*v.INSTANCE_LIVE, v.CLOSING)):
            provider = self.providers.get(inst.provider)
            if provider is None:  # its provider is not served now (started without --provider aws): leave it be
                if inst.id not in self._unserved:
                    self._unserved.add(inst.id)
                    log.warning("%s belongs to provider %r, which this backend does not run", inst.id, inst.provider)
                continue
            if not provider.alive(inst):
                failed = self._launch_failed(provider, inst)
                if isinstance(failed, CapacityError) and inst.status == v.LAUNCHING and inst.job_id:
                    self._no_capacity(inst, failed)
                    continue
                self.store.instances.set_state(inst.id, v.CLOSED, v.TERMINATED, job_id=None)
                gone = provider.cluster_error()
                if inst.job_id and gone:
                    self._cluster_lost(inst, gone)
                elif inst.job_id:
                    self._worker_lost(inst, failed)
            elif inst.status == v.COOLING and (inst.cooling_until or 0) <= now:
                self.close_instance(inst)
            elif inst.status == v.CLOSING and inst.substatus == v.STOPPING:
                self._check_stopping(provider, inst)
            elif inst.status == v.CLOSING and now - inst.updated > 10:
                provider.terminate(inst)
            elif inst.status == v.LAUNCHING and inst.id in self._ops:
                self._check_starting(inst)
            elif inst.status == v.LAUNCHING and inst.job_id:
                self._check_request(inst, now)

    def _check_stopping(self, provider: Provider, inst: InstanceRecord) -> None:
        """A stop in flight: CLOSED / STOPPED once the provider sees the machine stopped; terminate if it failed."""
        fut = self._ops.get(inst.id)
        if fut is not None and fut.done() and fut.exception() is not None:
            self._ops.pop(inst.id, None)
            log.warning("stopping %s failed (%s); terminating it", inst.id, fut.exception())
            self.store.instances.set_state(inst.id, v.CLOSING, v.TERMINATING)
            return
        polled = provider.poll(inst.id)
        if polled is not None and polled.state == "stopped":
            self._ops.pop(inst.id, None)
            self.store.instances.set_state(inst.id, v.CLOSED, v.STOPPED)

    def _check_starting(self, inst: InstanceRecord) -> None:
        """A stopped machine being started again for a job: a start that failed puts it back (stopped) and the job
        goes on: to the next machine at once on a capacity error, else to a new machine."""
        fut = self._ops[inst.id]
        if not fut.done():
            return
        self._ops.pop(inst.id, None)
        error = fut.exception()
        if error is None:
            return
        job = self.store.jobs.get(inst.job_id) if inst.job_id else None
        self.store.instances.set_state(inst.id, v.CLOSED, v.STOPPED, job_id=None)
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            return
        if isinstance(error, CapacityError):
            self._pass_over(inst, job, *self._capacity_messages(inst.machine_id, job, error), closed_as=v.STOPPED)
            return
        self.store.jobs.update(job.id, instance_id=None, machine_id=None)
        self._skip_stopped.add(inst.id)
        self.emit(job.id, v.EV_LOG, {"message": f"could not restart {inst.id} ({error}); starting a new one"})

    def _check_request(self, inst: InstanceRecord, now: float) -> None:
        """A machine that is not ready within the job's `wait_request_s` is given up for the next one in its list."""
        job = self.store.jobs.get(inst.job_id)
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            return
        waiting = self._report_pending(inst, job)
        wait = job.checked_spec.wait_request_s or 0.0
        asked = max([inst.created, *(h[2] for h in inst.history if h[0] == v.CLOSED)])
        if wait <= 0 or now - asked < wait:
            return
        self.providers[inst.provider].terminate(inst)
        machine = inst.machine_id
        listed = ", ".join(job.checked_spec.machines)
        self._pass_over(
            inst,
            job,
            f"{machine} was not ready within {wait:g} s" + (f" ({waiting})" if waiting else ""),
            f"none of the machines ({listed}) was ready within wait_request_s={wait:g} s; "
            "wait longer (--wait-request / wait_request_s) or list other machines",
        )

    def _report_pending(self, inst: InstanceRecord, job: JobRecord) -> str | None:
        """A provider that says what a launched instance still waits for (a Ray cluster with no free GPU) keeps
        its job QUEUING · REQUESTING SERVER with those words; once placed, the job goes on CONNECTING SERVER."""
        message = self.providers[inst.provider].pending(inst)
        if message:
            self._say_waiting(job, message)
        elif self._waiting.pop(job.id, None) is not None:
            self.set_status(job.id, v.QUEUING, v.CONNECTING_SERVER, f"placed {inst.id} ({inst.machine_id})")
        return message

    def _cluster_lost(self, inst: InstanceRecord, error: str) -> None:
        """The provider's whole cluster is gone (`ray stop`): its job fails with the provider's words, which name
        the cluster, instead of waiting for a machine that no longer exists."""
        job = self.store.jobs.get(inst.job_id)
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            return
        self.fail(job.id, f"{error}; start the cluster again (or list other machines) and submit the job again")

    def _pass_over(
        self,
        inst: InstanceRecord,
        job: JobRecord,
        message: str,
        none_left: str,
        closed_as: str = v.TERMINATED,
        status: str = v.CLOSED,
    ) -> None:
        """Give this machine up for this attempt of the job (a `passed_over` log event, which a restart keeps) and
        go on with the next one in its list (assigned later in the same tick), or fail the job with `none_left`.
        The instance ends `status` / `closed_as` (CLOSED / STOPPED: a stopped machine that could not start stays
        stopped; CLOSING: one still running, which the tick then terminates)."""
        self.store.instances.set_state(inst.id, status, closed_as, job_id=None)
        self.store.jobs.update(job.id, instance_id=None, machine_id=None)
        machine = inst.machine_id
        self.emit(job.id, v.EV_LOG, {"message": message, "passed_over": machine, "attempt": job.attempt})
        left = [m for m in job.checked_spec.machines if m not in self._passed_over(job)]
        if left:
            self.set_status(job.id, v.QUEUING, v.REQUESTING_SERVER, f"trying {left[0]}")
        else:
            self.fail(job.id, none_left)

    @staticmethod
    def _launch_failed(provider: Provider, inst: InstanceRecord) -> BaseException | None:
        """Why a provider whose launches finish later (a cloud) failed to start this instance, if it says."""
        if inst.status != v.LAUNCHING:
            return None
        try:
            return provider.launch_error(inst.id)
        except Exception:  # noqa: BLE001 - a provider's bookkeeping error is no reason to stop the tick
            log.exception("launch_error(%s) failed", inst.id)
            return None

    def _no_capacity(self, inst: InstanceRecord, error: BaseException) -> None:
        """The cloud had no room for this machine now: pass over to the next one in the job's list at once."""
        job = self.store.jobs.get(inst.job_id)
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            self.store.instances.set_state(inst.id, v.CLOSED, v.TERMINATED, job_id=None)
            return
        self._pass_over(inst, job, *self._capacity_messages(inst.machine_id, job, error))

    @staticmethod
    def _capacity_messages(machine: str, job: JobRecord, error: BaseException) -> tuple[str, str]:
        """The log line of a pass-over for lack of capacity, and the error if no machine is left."""
        listed = ", ".join(job.checked_spec.machines)
        return (
            f"{machine} has no capacity now ({getattr(error, 'code', '') or error}); trying the next machine",
            f"none of the machines ({listed}) had capacity now ({error}); try again later or list other machines "
            "(on-demand twins end in .od)",
        )

    def _passed_over(self, job: JobRecord) -> set[str]:
        """Machines this attempt of the job gave up waiting for, read from its event log so a restart keeps them."""
        return {
            e["data"]["passed_over"]
            for e in self.store.events.typed(job.id, (v.EV_LOG,))
            if "passed_over" in e["data"] and e["data"].get("attempt") == job.attempt
        }

    def _worker_lost(self, inst: InstanceRecord, launch_error: BaseException | None = None) -> None:
        job = self.store.jobs.get(inst.job_id)
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            return
        if job.cancel_requested:
            self.set_status(job.id, v.CANCELED, v.SUB_CANCELED, "canceled")
            return
        attempt = job.attempt + 1
        crashes = attempt - self._spot_interruptions(job)  # a machine the cloud reclaimed is no crash
        if crashes >= self.policy.max_attempts:
            self.fail(job.id, f"the worker was lost {crashes} times; giving up. See the worker log of {inst.id}.")
            return
        self.store.jobs.update(job.id, attempt=attempt, instance_id=None)
        done = job.epochs_done
        provider = self.providers.get(inst.provider)
        reason = provider.lost_reason(inst) if provider is not None else None
        why = f"could not start ({launch_error})" if launch_error else f"was lost ({reason})" if reason else "was lost"
        self.emit(job.id, v.EV_LOG, {"message": f"worker on {inst.id} {why}; resuming from epoch {done}"})
        self.set_status(job.id, v.QUEUING, v.REQUESTING_SERVER, f"resuming from epoch {done}")

    def refuse_agent(self, inst: InstanceRecord, reported: str, expected: str) -> None:
        """An agent of other code asked for a job: it never runs one. The machine closes with both versions in its
        state, and the job goes on with the next machine in its list, or fails naming both versions."""
        why = f"agent {reported} is not this backend's {expected}"
        log.warning("%s: %s; closing it", inst.id, why)
        job = self.store.jobs.get(inst.job_id) if inst.job_id else None
        if job is None or job.status not in v.JOB_ACTIVE or job.instance_id != inst.id:
            self.store.instances.set_state(inst.id, v.CLOSING, why, job_id=None)
            return
        message = f"{inst.id} ({inst.machine_id}) refused: {why}"
        fix = f"{message}: install this backend's agent there (GET /worker/agent serves it)"
        self._pass_over(inst, job, message, fix, closed_as=why, status=v.CLOSING)

    def spot_interrupted(self, job: JobRecord, inst: InstanceRecord, notice: str) -> None:
        """The worker of a spot machine stopped at a batch boundary because the cloud is reclaiming the machine
        (its finished epochs are checkpointed): the machine is terminated, and the job goes back to the queue to
        resume from its last epoch checkpoint on the next machine in its list (the same type again when it lists
        no other). Counted apart from crashes (`max_attempts`), up to MAX_SPOT_INTERRUPTIONS."""
        self.store.instances.set_state(inst.id, v.CLOSING, v.TERMINATING, job_id=None)
        provider = self.providers.get(inst.provider)
        if provider is not None:
            provider.terminate(inst)
        if job.status not in v.JOB_ACTIVE:
            return
        if job.cancel_requested:
            self.set_status(job.id, v.CANCELED, v.SUB_CANCELED, "canceled")
            return
        machine, done = inst.machine_id, job.epochs_done
        cloud = "AWS" if inst.provider == "aws" else "its cloud"
        interruptions = self._spot_interruptions(job) + 1
        self.emit(
            job.id,
            v.EV_LOG,
            {"message": f"{notice or 'spot interruption'} ({machine}, {inst.id})", v.SPOT_INTERRUPTED: machine},
        )
        if interruptions > MAX_SPOT_INTERRUPTIONS:
            self.fail(
                job.id,
                f"spot machines were reclaimed by {cloud} {interruptions} times; giving up. List an on-demand "
                f"machine ({machine.removesuffix('.od')}.od) to finish from epoch {done} without interruptions",
            )
            return
        attempt = job.attempt + 1
        self.store.jobs.update(job.id, attempt=attempt, instance_id=None, machine_id=None)
        others = [m for m in job.checked_spec.machines if m != machine]
        if others:  # this machine just went away: the next attempt tries the others first
            self.emit(
                job.id,
                v.EV_LOG,
                {"message": f"{machine} was reclaimed; trying {others[0]}", "passed_over": machine, "attempt": attempt},
            )
        message = (
            f"spot machine {machine} was reclaimed by {cloud}; resuming from epoch {done} on {(others or [machine])[0]}"
        )
        self.set_status(job.id, v.QUEUING, v.REQUESTING_SERVER, message)

    def _spot_interruptions(self, job: JobRecord) -> int:
        """How many times this job's machine was reclaimed, read from its event log (a restart keeps it)."""
        return sum(1 for e in self.store.events.typed(job.id, (v.EV_LOG,)) if v.SPOT_INTERRUPTED in e["data"])

    def _check_cancels(self) -> None:
        now = time.time()
        for job in self.store.jobs.list(statuses=v.JOB_ACTIVE):
            if job.spec is None:
                self.fail(job.id, f"the backend could not schedule this job: {unreadable_reason()}; submit it again")
                continue
            if not job.cancel_requested:
                continue
            if job.status == v.QUEUING and not job.instance_id:
                self.set_status(job.id, v.CANCELED, v.SUB_CANCELED, "canceled before it started")
            elif now - job.updated > self.policy.cancel_grace_s and job.instance_id:
                inst = self.store.instances.get(job.instance_id)
                if inst:
                    if inst.provider in self.providers:
                        self.providers[inst.provider].terminate(inst)
                    self.store.instances.set_state(inst.id, v.CLOSED, v.TERMINATED, job_id=None)
                self.set_status(job.id, v.CANCELED, v.SUB_CANCELED, "canceled; the worker did not stop in time")

    def _assign_queued(self) -> None:
        placement: _Placement | None = None
        for job in self.store.jobs.list(statuses=(v.QUEUING,)):
            if job.instance_id or job.cancel_requested:
                continue
            placement = placement or _Placement(self)
            try:
                if self._assign(job, placement):
                    placement = None  # it started, bound or closed an instance: the next job reads them again
            except Exception as exc:  # one bad job (an old row with a bad value) never blocks everyone else's
                log.exception("cannot schedule %s", job.id)
                placement = None
                self.fail(
                    job.id, f"the backend could not schedule this job ({type(exc).__name__}: {exc}); submit it again"
                )

    def _assign(self, job: JobRecord, placement: _Placement) -> bool:
        """Place one queued job on the first machine of its list that can take it now; True when that changed any
        instance (so the pass reads them again), False when the job waits or failed."""
        spec = job.checked_spec
        index = self.machine_index()
        passed = self._passed_over(job)
        waiting: list[str] = []
        unusable: list[str] = []  # machines of a provider whose cluster is gone: why
        for machine_id in spec.machines:
            warm = [
                i
                for i in placement.live
                if i.user_id == job.user_id and i.status == v.COOLING and i.machine_id == machine_id
            ]
            if warm:
                inst = warm[0]
                self.store.instances.set_state(
                    inst.id, v.EXECUTING, "", job_id=job.id, cool_down_s=spec.cool_down_s, cooling_until=None
                )
                self._waiting.pop(job.id, None)
                self._bind(job, inst.id, machine_id, f"reusing warm instance {inst.id}")
                return True
            if machine_id not in index or machine_id in passed:
                continue
            provider_name, offer = index[machine_id]
            gone = self.providers[provider_name].cluster_error()
            if gone:
                unusable.append(gone)
                continue
            live_user = [i for i in placement.live if i.user_id == job.user_id]
            stopped = [
                i
                for i in placement.stopped
                if i.user_id == job.user_id and i.machine_id == machine_id and i.id not in self._skip_stopped
            ]
            if stopped and len(live_user) < self.policy.max_active_instances and self._restart(job, stopped[-1]):
                return True
            live_machine = [i for i in placement.live if i.machine_id == machine_id]
            if len(live_user) >= self.policy.max_active_instances:
                cooling = [i for i in live_user if i.status == v.COOLING]
                if cooling:
                    self.close_instance(cooling[0])
                    placement.read()
                    continue
                waiting.append(
                    f"your {len(live_user)} active instances are the limit ({self.policy.max_active_instances}): "
                    "waiting for one of your jobs to end"
                )
                continue
            if len(live_machine) >= offer.capacity:
                if self._evict_cooling(job, machine_id, live_machine):
                    return True
                busy = sum(1 for i in live_machine if i.status != v.COOLING)
                waiting.append(
                    self.providers[provider_name].waiting_for(machine_id)
                    or f"waiting for {machine_id}: all {offer.capacity} in use ({busy} training)"
                )
                continue
            self._waiting.pop(job.id, None)
            self._launch(job, provider_name, machine_id)
            return True
        if waiting:
            self._say_waiting(job, waiting[0])
        elif unusable:
            self.fail(job.id, f"{unusable[0]}; start the cluster again or list other machines")
        return False

    def _restart(self, job: JobRecord, inst: InstanceRecord) -> bool:
        """Start a stopped machine again for this job (its worker comes back with the token it kept)."""
        try:
            fut = self.providers[inst.provider].start(inst)
        except Exception as exc:  # noqa: BLE001 - this one cannot start: launch a new one instead
            log.warning("cannot restart %s: %s", inst.id, exc)
            self._skip_stopped.add(inst.id)
            return False
        self._ops[inst.id] = fut
        offer = self.offer(inst.machine_id)
        price = offer.price_per_hour if offer is not None else None
        self.store.instances.set_state(
            inst.id,
            v.LAUNCHING,
            "",
            job_id=job.id,
            cool_down_s=job.checked_spec.cool_down_s,
            cooling_until=None,
            price_per_hour=float(price if price is not None else inst.price_per_hour or 0.0),
        )
        self._waiting.pop(job.id, None)
        self._bind(job, inst.id, inst.machine_id, f"restarting stopped instance {inst.id}")
        return True

    def _evict_cooling(self, job: JobRecord, machine_id: str, live: list[InstanceRecord]) -> bool:
        """A machine held warm (cooling) never blocks another job that waits for it: the one cooling longest is
        closed to make room, and the waiting job's log says so. Fair to its owner: warmth is a bonus, not a lease."""
        cooling = sorted((i for i in live if i.status == v.COOLING), key=lambda i: i.updated)
        if not cooling:
            return False
        victim = cooling[0]
        self.close_instance(victim)
        whose = "one of yours" if victim.user_id == job.user_id else "another user's"
        self.emit(
            job.id,
            v.EV_LOG,
            {"message": f"closed a cooling {machine_id} instance ({whose}) to make room for this job"},
        )
        return True

    def _say_waiting(self, job: JobRecord, message: str) -> None:
        """A queued job's substatus message says what it waits for (once per change, not every tick)."""
        if self._waiting.get(job.id) != message:
            self._waiting[job.id] = message
            self.set_status(job.id, v.QUEUING, v.REQUESTING_SERVER, message)

    def _launch(self, job: JobRecord, provider_name: str, machine_id: str) -> None:
        instance_id = "inst-" + secrets.token_hex(6)
        token = new_token("w")
        env = {"AIBRO_WORKER_URL": self.worker_url(), "AIBRO_INSTANCE_ID": instance_id}
        # A provider whose machines can read their own launch data (cloud user data) gets a one-time enrollment
        # token instead; the worker exchanges it for a fresh worker token (POST /worker/enroll), `token` is unused.
        enroll = new_token("e") if self.providers[provider_name].enrolls else None
        offer = self.offer(machine_id)
        if memory := launch_limit(self.policy, self.store, self.providers, offer):  # jobmemory.py
            env[MEMORY_VARIABLE] = str(memory)
        price = float(offer.price_per_hour if offer is not None else 0.0)
        self.store.instances.create(
            instance_id,
            job.user_id,
            provider_name,
            machine_id,
            token,
            job.checked_spec.cool_down_s,
            enroll,
            price_per_hour=price,
        )
        if enroll:
            env["AIBRO_ENROLL_TOKEN"] = enroll
        else:
            env["AIBRO_WORKER_TOKEN"] = token
        provider = self.providers[provider_name]
        try:
            pid = provider.launch(
                LaunchRequest(
                    instance_id,
                    machine_id,
                    env,
                    user_id=job.user_id,
                    job_id=job.id,
                    attempt=job.attempt,
                    tensorflow=tensorflow_pin(job.checked_spec.versions or {}),
                )
            )
        except Exception as exc:  # noqa: BLE001 - a launch failure moves on to the next machine next tick
            self.store.instances.set_state(instance_id, v.CLOSED, v.TERMINATED)
            self.emit(job.id, v.EV_LOG, {"message": f"could not start {machine_id}: {exc}"})
            return
        self.store.instances.update(instance_id, pid=pid)
        self.store.instances.set_state(instance_id, v.LAUNCHING, "", job_id=job.id)
        self._bind(job, instance_id, machine_id, f"started instance {instance_id}")

    def _bind(self, job: JobRecord, instance_id: str, machine_id: str, message: str) -> None:
        self.store.jobs.update(job.id, instance_id=instance_id, machine_id=machine_id)
        self.set_status(job.id, v.QUEUING, v.CONNECTING_SERVER, f"{message} ({machine_id})")
