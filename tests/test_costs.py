"""Cost arithmetic (issue 11 item 9): EC2's per-second billing with a 60 s minimum per start, at the price the
instance was started at; a job pays the seconds it held an instance and the minimum of a start it caused;
cooling is the instance's own. Unit tests of costs.py, plus the store recording which job held an instance."""

from __future__ import annotations

from pathlib import Path

import pytest

from aibro_backend.providers.aws_catalog import offers
from aibro_backend.scheduling.costs import billed_seconds, instance_cost, job_costs, starts
from aibro_backend.storage.records import InstanceRecord
from aibro_backend.storage.store import Store
from aibro_core import vocabulary as v

pytestmark = pytest.mark.fast

L, E, C, X = v.LAUNCHING, v.EXECUTING, v.COOLING, v.CLOSING
SPOT = next(o for o in offers("us-east-1") if o.machine_id == "g4dn.xlarge")
OD = next(o for o in offers("us-east-1") if o.machine_id == "g4dn.xlarge.od")


def near(x: float) -> object:
    """Costs are rounded to 1e-6 USD."""
    return pytest.approx(x, abs=2e-6)


def inst(history: list[list], price: float | None) -> InstanceRecord:
    first = history[0][2] if history else 0.0
    return InstanceRecord(
        id="inst-1", user_id=1, provider="aws", machine_id="g4dn.xlarge", status=history[-1][0] if history else L,
        substatus="", pid=None, job_id=None, cool_down_s=0.0, cooling_until=None, created=first, updated=first,
        last_seen=None, history=history, price_per_hour=price,
    )  # fmt: skip


def test_billing_is_per_whole_second_with_a_60_s_minimum() -> None:
    assert billed_seconds(0.2) == 60 and billed_seconds(59.99) == 60 and billed_seconds(60) == 60
    assert billed_seconds(61.01) == 62, "a started second is billed whole"
    assert billed_seconds(3600) == 3600
    assert billed_seconds(12.4, reported=False) == 13, "a machine that never reported pays no minimum"
    assert billed_seconds(0, reported=False) == 0, "a launch EC2 refused costs nothing"


def test_a_short_job_pays_the_minimum_at_the_on_demand_price() -> None:
    price = OD.price_per_hour
    history = [[L, "", 100.0, "job-a"], [E, "", 110.0, "job-a"], [X, v.STOPPING, 130.0, None]]
    got = instance_cost(inst(history, price), now=1000.0)
    assert got.billed_s == 60
    assert got.cost == near(60 * price / 3600)
    assert got.by_job == {"job-a": near(60 * price / 3600)}, "the 30 s it ran plus the minimum's 30"
    assert got.cooling_cost == 0


def test_spot_and_on_demand_differ_only_by_the_price_recorded_at_launch() -> None:
    history = [[L, "", 0.0, "job-a"], [E, "", 20.0, "job-a"], [X, v.TERMINATING, 200.0, None]]
    spot = instance_cost(inst(history, SPOT.price_per_hour), now=500.0)
    od = instance_cost(inst(history, OD.price_per_hour), now=500.0)
    assert spot.billed_s == od.billed_s == 200
    assert od.cost == near(200 * OD.price_per_hour / 3600)
    assert spot.cost == near(200 * SPOT.price_per_hour / 3600)
    assert spot.cost < od.cost


def test_cooling_is_the_instances_and_a_warm_reuse_pays_no_minimum() -> None:
    price = 3.6  # $0.001 a second
    history = [
        [L, "", 0.0, "job-a"],
        [E, "", 30.0, "job-a"],
        [C, "", 100.0, None],  # job-a done, cooling 20 s
        [E, "", 120.0, "job-b"],  # job-b reuses it warm
        [C, "", 125.0, None],
        [X, v.TERMINATING, 135.0, None],
    ]
    got = instance_cost(inst(history, price), now=999.0)
    assert got.billed_s == 135 and got.cost == near(0.135)
    assert got.by_job == {"job-a": near(0.100), "job-b": near(0.005)}, "5 s, no minimum"
    assert got.cooling_cost == near(0.030)
    assert sum(got.by_job.values()) + got.cooling_cost == near(got.cost)


def test_each_restart_of_a_stopped_instance_is_a_start_of_its_own() -> None:
    price = 3.6
    history = [
        [L, "", 0.0, "job-a"],
        [E, "", 10.0, "job-a"],
        [C, "", 40.0, None],
        [X, v.STOPPING, 45.0, None],
        [v.CLOSED, v.STOPPED, 50.0, None],
        [L, "", 500.0, "job-b"],  # restarted for job-b
        [E, "", 505.0, "job-b"],
        [C, "", 600.5, None],
        [X, v.STOPPING, 601.2, None],
        [v.CLOSED, v.STOPPED, 603.0, None],
    ]
    runs = starts(history, now=1000.0)
    assert [(r.begin, r.end, r.first_job) for r in runs] == [(0.0, 45.0, "job-a"), (500.0, 601.2, "job-b")]
    got = instance_cost(inst(history, price), now=1000.0)
    assert got.billed_s == 60 + 102, "the stopped time between is free; each start has its own minimum"
    assert got.by_job["job-a"] == near(0.040 + 0.015), "its 40 s and the minimum's 15 s"
    assert got.by_job["job-b"] == near(0.1005 + 0.0008), "its 100.5 s and the rounding to 102 s"
    assert got.cooling_cost == near(0.005 + 0.0007)


def test_a_resumed_job_pays_on_every_instance_it_held_and_a_running_one_until_now() -> None:
    price = 3.6
    lost = inst([[L, "", 0.0, "job-r"], [E, "", 10.0, "job-r"], [v.CLOSED, v.TERMINATED, 20.0, None]], price)
    second = inst([[L, "", 30.0, "job-r"], [E, "", 40.0, "job-r"]], price)  # still training
    costs = job_costs([lost, second], now=130.0)
    assert costs == {"job-r": near(0.060 + 0.100)}, "minimum on the lost one, 100 s so far on the new"
    local = inst([[L, "", 0.0, "job-l"], [E, "", 1.0, "job-l"], [C, "", 500.0, None]], 0.0)
    assert job_costs([local], now=600.0) == {"job-l": 0.0}, "local machines cost nothing"
    old = inst([[L, "", 0.0], [E, "", 1.0]], None)
    assert job_costs([old], now=50.0) == {}, "rows stored before jobs were recorded bill no job"


def test_the_store_records_the_job_an_instance_holds_and_its_start_price(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    uid = store.users.ensure("ann")
    store.instances.create("inst-1", uid, "aws", "g4dn.xlarge.od", "tok", 5.0, price_per_hour=0.526)
    store.instances.set_state("inst-1", L, "", job_id="job-a")  # bound just after it is made: same entry
    store.instances.set_state("inst-1", E, "")
    store.instances.set_state("inst-1", C, "", job_id=None)
    store.instances.set_state("inst-1", E, "", job_id="job-b")
    row = store.instances.get("inst-1")
    assert row.price_per_hour == 0.526
    assert [(h[0], h[3]) for h in row.history] == [(L, "job-a"), (E, "job-a"), (C, None), (E, "job-b")]
    assert set(job_costs([row], now=row.history[-1][2] + 10)) == {"job-a", "job-b"}
