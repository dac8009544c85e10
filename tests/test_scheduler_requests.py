"""The scheduler alone (a real store, a scripted provider): a machine that is not ready within the job's
`wait_request_s` is given up and the next machine in the job's list is tried; when none is left, the job fails
with an error that names the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aibro_backend.policy import Policy
from aibro_backend.scheduler import Scheduler
from aibro_backend.store import Store
from aibro_core import vocabulary as v


class ScriptedProvider:
    """Offers two machines; `boots` says which ones ever get ready (the scheduler only sees LAUNCHING)."""

    name = "scripted"

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.terminated: list[str] = []

    def offers(self) -> list[dict[str, Any]]:
        return [{"machine_id": m, "provider": self.name, "capacity": 2} for m in ("spot-a", "spot-b")]

    def launch(self, instance_id: str, machine_id: str, env: dict[str, str], user_id: int | None = None) -> int | None:
        self.launched.append(machine_id)
        return None

    def alive(self, instance: dict[str, Any]) -> bool:
        return instance["id"] not in self.terminated

    def terminate(self, instance: dict[str, Any]) -> None:
        self.terminated.append(instance["id"])


@pytest.fixture()
def world(tmp_path: Path):  # noqa: ANN201
    store = Store(tmp_path / "aibro.db")
    provider = ScriptedProvider()
    sched = Scheduler(store, {"scripted": provider}, Policy(), lambda: "http://127.0.0.1:9", lambda ev: None)
    uid = store.ensure_user("u")
    yield store, provider, sched, uid
    store.close()


def _job(store: Store, uid: int, machines: list[str], wait: float) -> str:
    spec = {"machines": machines, "cool_down_s": 0, "wait_request_s": wait, "fit": {"epochs": 1}}
    store.create_job("job-1", uid, spec)
    return "job-1"


def _age_launch(store: Store, seconds: float) -> None:
    """Pretend the LAUNCHING instance was asked for `seconds` ago."""
    store.db.execute("UPDATE instances SET created = created - ? WHERE status=?", (seconds, v.LAUNCHING))


def test_a_machine_not_ready_in_time_is_passed_over_for_the_next(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=30)
    sched.tick()
    assert provider.launched == ["spot-a"] and store.job(job_id)["machine_id"] == "spot-a"
    _age_launch(store, 10)
    sched.tick()
    assert provider.launched == ["spot-a"], "still within wait_request_s: keep waiting"
    _age_launch(store, 25)
    sched.tick()  # gives spot-a up
    sched.tick()  # and asks for spot-b
    assert provider.launched == ["spot-a", "spot-b"]
    job = store.job(job_id)
    assert job["machine_id"] == "spot-b" and job["status"] == v.QUEUING
    first = [i for i in store.instances() if i["machine_id"] == "spot-a"]
    assert [i["status"] for i in first] == [v.CLOSED] and provider.terminated == [first[0]["id"]]
    logs = [e["data"]["message"] for e in store.typed_events(job_id, (v.EV_LOG,))]
    assert "spot-a was not ready within 30 s" in logs


def test_none_ready_fails_the_job_with_the_fix(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=5)
    for _ in range(2):
        sched.tick()
        _age_launch(store, 6)
        sched.tick()
    assert provider.launched == ["spot-a", "spot-b"]
    job = store.job(job_id)
    assert job["status"] == v.CANCELED
    error = next(e["data"]["message"] for e in store.typed_events(job_id, (v.EV_ERROR,)))
    assert "none of the machines (spot-a, spot-b) was ready within wait_request_s=5 s" in error
    assert "--wait-request" in error


def test_zero_waits_as_long_as_it_takes(world) -> None:  # noqa: ANN001
    store, provider, sched, uid = world
    job_id = _job(store, uid, ["spot-a", "spot-b"], wait=0)
    sched.tick()
    _age_launch(store, 3600)
    sched.tick()
    assert provider.launched == ["spot-a"] and store.job(job_id)["machine_id"] == "spot-a"
