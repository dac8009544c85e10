"""The scheduler alone (a real store, a scripted provider): a machine that is not ready within the job's
`wait_request_s` is given up and the next machine in the job's list is tried; when none is left, the job fails
with an error that names the fix."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from records import job_spec

from aibro_backend.providers.base import CapacityError, LaunchRequest, PollResult, Provider
from aibro_backend.scheduling.policy import Policy
from aibro_backend.scheduling.scheduler import Scheduler
from aibro_backend.storage.records import InstanceRecord
from aibro_backend.storage.store import Store
from aibro_core import vocabulary as v
from aibro_core.models import Machine

pytestmark = pytest.mark.fast


def machine(machine_id: str, provider: str, *, capacity: int, spot: bool) -> Machine:
    """A one-CPU machine with no price."""
    return Machine(
        machine_id=machine_id,
        provider=provider,
        gpu_type=None,
        gpu_count=0,
        vcpus=1,
        memory_gib=1.0,
        price_per_hour=0.0,
        on_demand_price_per_hour=0.0,
        spot=spot,
        availability="available",
        capacity=capacity,
    )


class ScriptedProvider(Provider):
    """Offers two machines; `boots` says which ones ever get ready (the scheduler only sees LAUNCHING). Written from
    providers/base.py alone: the four required operations, the rest left at their defaults."""

    name = "scripted"

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.terminated: list[str] = []

    def offers(self) -> list[Machine]:
        return [machine(m, self.name, capacity=2, spot=True) for m in ("spot-a", "spot-b")]

    def launch(self, request: LaunchRequest) -> int | None:
        self.launched.append(request.machine_id)
        return None

    def alive(self, instance: InstanceRecord) -> bool:
        return instance.id not in self.terminated

    def terminate(self, instance: InstanceRecord) -> None:
        self.terminated.append(instance.id)


@pytest.fixture()
def world(tmp_path: Path):  # noqa: ANN201
    store = Store(tmp_path / "aibro.db")
    provider = ScriptedProvider()
    sched = Scheduler(store, {"scripted": provider}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    uid = store.users.ensure("u")
    yield store, provider, sched, uid
    store.close()


def _job(store: Store, uid: int, machines: list[str], wait: float, versions: dict[str, str] | None = None) -> str:
    spec = job_spec(machines=machines, cool_down_s=0, wait_request_s=wait, versions=versions or {})
    store.jobs.create("job-1", uid, spec)
    return "job-1"


def _age_launch(store: Store, seconds: float) -> None:
    """Pretend the LAUNCHING instance was asked for `seconds` ago."""
    store.db.execute("UPDATE instances SET created = created - ? WHERE status=?", (seconds, v.LAUNCHING))


def test_a_machine_not_ready_in_time_is_passed_over_for_the_next(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=30)
    sched.tick()
    assert provider.launched == ["spot-a"] and store.jobs.get(job_id).machine_id == "spot-a"
    _age_launch(store, 10)
    sched.tick()
    assert provider.launched == ["spot-a"], "still within wait_request_s: keep waiting"
    _age_launch(store, 25)
    sched.tick()  # gives spot-a up
    sched.tick()  # and asks for spot-b
    assert provider.launched == ["spot-a", "spot-b"]
    job = store.jobs.get(job_id)
    assert job.machine_id == "spot-b" and job.status == v.QUEUING
    first = [i for i in store.instances.list() if i.machine_id == "spot-a"]
    assert [i.status for i in first] == [v.CLOSED] and provider.terminated == [first[0].id]
    logs = [e["data"]["message"] for e in store.events.typed(job_id, (v.EV_LOG,))]
    assert "spot-a was not ready within 30 s" in logs


def test_none_ready_fails_the_job_with_the_fix(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=5)
    for _ in range(2):
        sched.tick()
        _age_launch(store, 6)
        sched.tick()
    assert provider.launched == ["spot-a", "spot-b"]
    job = store.jobs.get(job_id)
    assert job.status == v.CANCELED
    error = next(e["data"]["message"] for e in store.events.typed(job_id, (v.EV_ERROR,)))
    assert "none of the machines (spot-a, spot-b) was ready within wait_request_s=5 s" in error
    assert "--wait-request" in error


def test_zero_waits_as_long_as_it_takes(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=0)
    sched.tick()
    _age_launch(store, 3600)
    sched.tick()
    assert provider.launched == ["spot-a"] and store.jobs.get(job_id).machine_id == "spot-a"


# -- a provider whose launches finish later (a cloud: the AWS provider's shape) ----------------------------------
class AsyncScriptedProvider(ScriptedProvider):
    """Launches are in flight until the test settles them: `pending` ones stay alive, `failures` hold the error a
    launch ended with (alive turns false and launch_error says why), as AwsProvider reports them."""

    name = "cloud"
    enrolls = True

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, str] = {}
        self.failures: dict[str, BaseException] = {}
        self.envs: list[dict[str, str]] = []
        self.launch_kwargs: list[dict[str, Any]] = []

    def launch(self, request: LaunchRequest) -> None:
        self.launched.append(request.machine_id)
        self.envs.append(dict(request.env))
        self.launch_kwargs.append(
            {"job_id": request.job_id, "attempt": request.attempt, "tensorflow": request.tensorflow}
        )
        self.state[request.instance_id] = "launching"

    def poll(self, instance_id: str) -> PollResult | None:
        return PollResult(self.state[instance_id]) if instance_id in self.state else None

    def launch_error(self, instance_id: str) -> BaseException | None:
        return self.failures.get(instance_id)

    def alive(self, instance: InstanceRecord) -> bool:
        return self.state.get(instance.id) in ("launching", "pending", "running")

    def fail(self, instance_id: str, error: BaseException) -> None:
        self.state[instance_id], self.failures[instance_id] = "failed", error


@pytest.fixture()
def cloud(tmp_path: Path):  # noqa: ANN201
    store = Store(tmp_path / "aibro.db")
    provider = AsyncScriptedProvider()
    sched = Scheduler(store, {"cloud": provider}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    uid = store.users.ensure("u")
    yield store, provider, sched, uid
    store.close()


def _launching(store: Store) -> InstanceRecord:
    (inst,) = store.instances.list(statuses=(v.LAUNCHING,))
    return inst


def test_the_launch_names_the_kernels_tensorflow_for_a_machine_without_one(cloud) -> None:  # noqa: ANN001
    store, provider, sched, uid = cloud
    _job(store, uid, ["spot-a"], wait=0, versions={"python": "3.11.7", "tensorflow": "2.20.1", "keras": "3.12.0"})
    sched.tick()
    assert [kw["tensorflow"] for kw in provider.launch_kwargs] == ["2.20"]


def test_a_cloud_launch_stays_launching_while_pending_and_enrolls(cloud) -> None:  # noqa: ANN001
    store, provider, sched, uid = cloud
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=0)
    sched.tick()
    inst = _launching(store)
    (env,) = provider.envs
    assert "AIBRO_WORKER_TOKEN" not in env, "a cloud machine's launch data holds no long-lived token"
    assert env["AIBRO_ENROLL_TOKEN"].startswith("aibro_e_") and env["AIBRO_INSTANCE_ID"] == inst.id
    assert provider.launch_kwargs == [{"job_id": job_id, "attempt": 0, "tensorflow": None}], "tagged with its job"
    inst, token = store.instances.enroll(env["AIBRO_ENROLL_TOKEN"])
    assert inst is not None and store.instances.for_token(token).id == inst.id
    for state in ("launching", "pending", "pending", "running"):
        provider.state[inst.id] = state
        sched.tick()
        assert store.instances.get(inst.id).status == v.LAUNCHING
        job = store.jobs.get(job_id)
        assert (job.status, job.substatus, job.instance_id) == (v.QUEUING, v.CONNECTING_SERVER, inst.id)
    assert provider.launched == ["spot-a"]


def test_a_capacity_error_passes_over_to_the_next_machine_in_the_same_tick(cloud) -> None:  # noqa: ANN001
    from aibro_backend.providers.aws import CapacityError

    store, provider, sched, uid = cloud
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=600)
    sched.tick()
    first = _launching(store)
    provider.state[first.id] = "pending"
    sched.tick()
    provider.fail(first.id, CapacityError("spot-a", "InsufficientInstanceCapacity", "no room in us-east-1a"))
    sched.tick()
    assert provider.launched == ["spot-a", "spot-b"], "the next machine is asked for in the same tick"
    assert store.instances.get(first.id).status == v.CLOSED
    job = store.jobs.get(job_id)
    assert job.machine_id == "spot-b" and job.attempt == 0, "a machine without room is no lost worker"
    logs = [e["data"] for e in store.events.typed(job_id, (v.EV_LOG,))]
    passed = [d for d in logs if "passed_over" in d]
    assert passed == [
        {
            "message": "spot-a has no capacity now (InsufficientInstanceCapacity); trying the next machine",
            "passed_over": "spot-a",
            "attempt": 0,
        }
    ]
    assert not any("was lost" in d["message"] for d in logs)
    second = _launching(store)
    provider.fail(second.id, CapacityError("spot-b", "SpotMaxPriceTooLow", "price"))
    sched.tick()
    job = store.jobs.get(job_id)
    assert job.status == v.CANCELED and provider.launched == ["spot-a", "spot-b"]
    error = next(e["data"]["message"] for e in store.events.typed(job_id, (v.EV_ERROR,)))
    assert error.startswith("none of the machines (spot-a, spot-b) had capacity now"), error


def test_a_launch_that_fails_otherwise_is_a_lost_worker_retried(cloud) -> None:  # noqa: ANN001
    store, provider, sched, uid = cloud
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=0)
    sched.tick()
    first = _launching(store)
    provider.fail(first.id, RuntimeError("UnauthorizedOperation: not allowed"))
    sched.tick()
    job = store.jobs.get(job_id)
    assert job.attempt == 1 and provider.launched == ["spot-a", "spot-a"], "retried as a new attempt"
    logs = [e["data"]["message"] for e in store.events.typed(job_id, (v.EV_LOG,))]
    assert f"worker on {first.id} could not start (UnauthorizedOperation: not allowed); resuming from epoch 0" in logs


def test_reconcile_and_adopt_reach_providers_that_have_them(cloud) -> None:  # noqa: ANN001
    from concurrent.futures import Future

    store, provider, sched, uid = cloud
    seen: list[Any] = []

    def done(value: Any) -> Future:
        f: Future = Future()
        f.set_result(value)
        seen.append(value)
        return f

    provider.adopt = lambda: done("adopted")  # type: ignore[attr-defined]
    provider.reconcile = lambda ids: done(sorted(ids))  # type: ignore[attr-defined]
    _job(store, uid, ["spot-a"], wait=0)
    sched.tick()
    assert [f.result() for f in sched.adopt_all()] == ["adopted"]
    assert [f.result() for f in sched.reconcile_all()] == [[_launching(store).id]]
    plain = Scheduler(store, {"scripted": ScriptedProvider()}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    assert plain.adopt_all() == [] and plain.reconcile_all() == [], "the local kind has none: nothing to do"


# -- stopped on-demand machines (issue 11 item 6) -------------------------------------------------------------------
class StoppingProvider(AsyncScriptedProvider):
    """An on-demand machine `od-a` that can be stopped and started again (Futures settled by the test)."""

    can_stop = True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []
        self.futures: dict[str, Future] = {}

    def offers(self) -> list[Machine]:
        return [machine("od-a", self.name, capacity=5, spot=False)]

    def alive(self, instance: InstanceRecord) -> bool:
        return self.state.get(instance.id) in ("launching", "pending", "running", "stopping", "stopped")

    def _op(self, kind: str, instance: InstanceRecord) -> Future:
        self.ops.append((kind, instance.id))
        self.futures[instance.id] = fut = Future()
        return fut

    def stop(self, instance: InstanceRecord) -> Future:
        self.state[instance.id] = "stopping"
        return self._op("stop", instance)

    def start(self, instance: InstanceRecord) -> Future:
        return self._op("start", instance)


def _od_job(store: Store, uid: int, job_id: str, cool_down_s: float = 0) -> str:
    spec = job_spec(machines=["od-a"], cool_down_s=cool_down_s, wait_request_s=600)
    store.jobs.create(job_id, uid, spec)
    return job_id


def test_an_on_demand_cloud_machine_is_stopped_after_its_job_and_restarted_for_the_next(tmp_path: Path) -> None:
    store = Store(tmp_path / "aibro.db")
    provider = StoppingProvider()
    policy = Policy(max_stopped_instances=1)
    sched = Scheduler(store, {"cloud": provider}, policy, lambda: "http://127.0.0.1:9", lambda ev: None)
    uid = store.users.ensure("u")
    first = _od_job(store, uid, "job-1")
    sched.tick()
    inst = _launching(store)
    provider.state[inst.id] = "running"
    store.jobs.update(first, status=v.COMPLETED)
    sched.release_instance(store.instances.get(inst.id))  # no cool-down: closed now, and on-demand: stopped
    assert store.instances.get(inst.id).substatus == v.STOPPING and provider.ops == [("stop", inst.id)]
    for _ in range(3):
        sched.tick()  # stopping is no reason to terminate it
    assert store.instances.get(inst.id).status == v.CLOSING and provider.terminated == []
    provider.state[inst.id] = "stopped"
    provider.futures[inst.id].set_result("stopped")
    sched.tick()
    assert (store.instances.get(inst.id).status, store.instances.get(inst.id).substatus) == (v.CLOSED, v.STOPPED)

    second = _od_job(store, uid, "job-2")
    sched.tick()
    assert provider.ops[-1] == ("start", inst.id) and provider.launched == ["od-a"], "restarted, not launched"
    job = store.jobs.get(second)
    assert job.instance_id == inst.id and "restarting stopped instance" in store.events.typed(second, (v.EV_STATUS,))[
        -1
    ]["data"].get("message", "")
    assert store.instances.get(inst.id).status == v.LAUNCHING
    provider.futures[inst.id].set_result("pending")
    provider.state[inst.id] = "running"
    sched.tick()
    assert store.instances.get(inst.id).status == v.LAUNCHING and store.jobs.get(second).instance_id == inst.id

    # A second machine while one is already stopped: over the limit of 1, it is terminated instead.
    other = _od_job(store, uid, "job-3")
    sched.tick()
    (new,) = [i for i in store.instances.list(statuses=(v.LAUNCHING,)) if i.id != inst.id]
    provider.state[new.id] = "running"
    store.jobs.update(second, status=v.COMPLETED)
    sched.release_instance(store.instances.get(inst.id))
    store.jobs.update(other, status=v.COMPLETED)
    sched.release_instance(store.instances.get(new.id))
    assert store.instances.get(inst.id).substatus == v.STOPPING
    assert store.instances.get(new.id).substatus == v.TERMINATING, "one stopping already fills the limit of 1"
    store.close()


def test_a_restart_without_capacity_passes_over_and_stays_stopped(tmp_path: Path) -> None:

    store = Store(tmp_path / "aibro.db")
    provider = StoppingProvider()
    sched = Scheduler(store, {"cloud": provider}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    uid = store.users.ensure("u")
    _od_job(store, uid, "job-1")
    sched.tick()
    inst = _launching(store)
    provider.state[inst.id] = "running"
    store.jobs.update("job-1", status=v.COMPLETED)
    sched.release_instance(store.instances.get(inst.id))
    provider.state[inst.id] = "stopped"
    provider.futures[inst.id].set_result("stopped")
    sched.tick()
    _od_job(store, uid, "job-2")
    sched.tick()
    provider.futures[inst.id].set_exception(CapacityError("InsufficientInstanceCapacity"))
    sched.tick()
    row = store.instances.get(inst.id)
    assert (row.status, row.substatus) == (v.CLOSED, v.STOPPED), "still kept for later"
    job = store.jobs.get("job-2")
    assert job.status == v.CANCELED and provider.launched == ["od-a"]
    passed = [e["data"] for e in store.events.typed("job-2", (v.EV_LOG,)) if "passed_over" in e["data"]]
    assert [d["passed_over"] for d in passed] == ["od-a"]
    store.close()


def test_instances_of_a_provider_not_served_now_never_stop_the_tick(tmp_path: Path) -> None:
    """A backend restarted without --provider aws still holds its AWS rows: they are left alone (warned once) and
    every other job is scheduled as usual."""
    store = Store(tmp_path / "aibro.db")
    uid = store.users.ensure("u")
    store.instances.create("inst-cloud", uid, "aws", "g4dn.xlarge.od", "aibro_w_x", 0)
    provider = ScriptedProvider()
    sched = Scheduler(store, {"scripted": provider}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    _job(store, uid, ["spot-a"], wait=0)
    sched.tick()
    sched.tick()
    assert provider.launched == ["spot-a"] and store.instances.get("inst-cloud").status == v.LAUNCHING
    store.close()


def test_one_tick_places_a_queue_against_capacity_it_has_just_used(world) -> None:  # noqa: ANN001
    """The tick reads the instances once for its whole pass, and again after each placement: three queued jobs on
    machines of capacity 2 start two instances in one tick, and the third job says it waits (it never launches a
    third on a view read before the first two started)."""
    store, provider, sched, uid = world
    for n in range(3):
        spec = job_spec(machines=["spot-a"], cool_down_s=0, wait_request_s=60)
        store.jobs.create(f"job-{n}", uid, spec)
        store.jobs.update(f"job-{n}", status=v.QUEUING, substatus=v.REQUESTING_SERVER)
    sched.tick()
    assert provider.launched == ["spot-a", "spot-a"]
    assert [store.jobs.get(f"job-{n}").instance_id is not None for n in range(3)] == [True, True, False]
    assert "all 2 in use" in store.events.typed("job-2", (v.EV_STATUS,))[-1]["data"]["message"]
