"""Issue 11 item 11 (and item 9's costs) end to end through moto: `%%cloud_fit --machine g4dn.xlarge.od,g4dn.xlarge`
cells in a real kernel train on a played EC2 instance; the machine cools and the next cell's job reuses it warm;
its cool-down ends and it is STOPPED; the third cell's job restarts the same EC2 instance (one launch in all).
The user sees each fit's epochs and final accuracy, the panel's cost, and `%cloud_timeline`'s gear-up seconds and
cost per job, which equal what the instances' billed history gives."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import boto3  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import pytest
from aws_moto import PlayedInstances, make_account, moto_server, write_config  # noqa: E402
from backend_proc import own_backend  # noqa: E402
from kernel_helpers import CellResult, digits_setup, run_cell, start_kernel  # noqa: E402
from records import from_view  # noqa: E402

from aibro_backend.providers.aws_catalog import offers  # noqa: E402
from aibro_backend.providers.aws_config import load_aws_config  # noqa: E402
from aibro_backend.scheduling.costs import billed_seconds, instance_cost  # noqa: E402
from aibro_core import vocabulary as v  # noqa: E402
from aibro_core.models import Instance, Job  # noqa: E402

SETUP = digits_setup()
MACHINES = "g4dn.xlarge.od,g4dn.xlarge"
OD_PRICE = next(o for o in offers("us-east-1") if o.machine_id == "g4dn.xlarge.od").price_per_hour


def fit_cell(tag: str, cool_down: float) -> str:
    return (
        f'%%cloud_fit --machine {MACHINES} --cool-down {cool_down:g} --description "{tag}"\n'
        "model = build()\n"
        "history = model.fit(x_train, y_train, epochs=2, batch_size=32, validation_data=(x_val, y_val))\n"
        "acc = model.evaluate(x_val, y_val, verbose=0)[1]\n"
        f"print('FINAL {tag}', round(acc, 4), round(history.history['val_accuracy'][-1], 4))\n"
    )


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """moto, a backend with the AWS provider, the harness that plays its instances, and a kernel pointed at it."""
    root = tmp_path_factory.mktemp("aws-kernel")
    with moto_server() as aws_env:
        config = write_config(root / "aws.toml", make_account())
        backend_id = load_aws_config(config).backend_id
        with own_backend(root / "home", "--provider", "aws", "--aws-config", str(config), **aws_env) as b:
            with PlayedInstances(backend_id, b.url, root / "machines", aws_env) as machines:
                km, kc = start_kernel(
                    {"AIBRO_HOME": str(root / "kernel-home"), "AIBRO_BACKEND_URL": b.url, "AIBRO_TOKEN": b.token}
                )
                try:
                    res = run_cell(kc, SETUP, timeout=300)
                    assert not res.error, res.error
                    yield {"backend": b, "machines": machines, "kernel": kc, "client": b.client()}
                finally:
                    kc.stop_channels()
                    km.shutdown_kernel(now=True)


def _fit(played: dict[str, Any], tag: str, cool_down: float) -> tuple[CellResult, Job]:
    """Run one %%cloud_fit cell; what it printed and its job."""
    res = run_cell(played["kernel"], fit_cell(tag, cool_down), timeout=600)
    assert not res.error, res.error + res.stdout[-3000:]
    assert "Epoch 2/2" in res.stdout, res.stdout
    final = re.search(rf"FINAL {tag} (\S+) (\S+)", res.stdout)
    assert final and final.group(1) == final.group(2), f"the trained model came back into `model`: {res.stdout}"
    assert float(final.group(1)) > 0.5, res.stdout
    job = next(j for j in reversed(played["client"].jobs()) if j.description == tag)
    assert job.status == v.COMPLETED and job.machine_id == "g4dn.xlarge.od", job
    return res, job


def _instance(played: dict[str, Any], instance_id: str) -> Instance:
    return {i.id: i for i in played["client"].instances()}[instance_id]


def _wait_state(played: dict[str, Any], instance_id: str, state: tuple[str, str], timeout: float = 180) -> Instance:
    deadline = time.monotonic() + timeout
    while True:
        inst = _instance(played, instance_id)
        if (inst.status, inst.substatus) == state or time.monotonic() > deadline:
            return inst
        time.sleep(0.5)


def _held_s(job: Job) -> float:
    """From the job's timeline: bound to its instance (CONNECTING SERVER) until it ended."""
    ts = {(e.status, e.substatus): e.ts for e in job.timeline}
    return ts[(v.COMPLETED, v.SUB_COMPLETED)] - ts[(v.QUEUING, v.CONNECTING_SERVER)]


def test_three_cells_launch_reuse_warm_then_restart_the_stopped_machine_and_bill_it(played: dict) -> None:
    client, machines = played["client"], played["machines"]

    first_res, first = _fit(played, "first", cool_down=120)
    inst = _instance(played, first.instance_id)
    assert inst.status == v.COOLING and inst.price_per_hour == OD_PRICE, inst
    (ec2_id,) = machines.envs
    shown = [val for _, st in first_res.updates for val in st.values() if isinstance(val, str) and "$" in val]
    assert any(re.search(r"\$0\.0*[1-9]", s) for s in shown), f"the panel shows the job's cost: {shown[-3:]}"

    _, second = _fit(played, "second", cool_down=1)
    assert second.instance_id == first.instance_id, "the warm machine was reused"
    inst = _wait_state(played, first.instance_id, (v.CLOSED, v.STOPPED))
    assert (inst.status, inst.substatus) == (v.CLOSED, v.STOPPED), inst

    _, third = _fit(played, "third", cool_down=0)
    assert third.instance_id == first.instance_id, "the stopped machine was restarted"
    assert list(machines.envs) == [ec2_id], "one EC2 instance was launched in all"
    inst = _wait_state(played, first.instance_id, (v.CLOSED, v.STOPPED))
    states = [(h[0], h[1], h[3] if len(h) > 3 else None) for h in inst.history]
    ids = {first.job_id: "1", second.job_id: "2", third.job_id: "3", None: "-"}
    walk = [(s, sub, ids[j]) for s, sub, j in states]
    cooling, stopped = (v.COOLING, "", "-"), (v.CLOSED, v.STOPPED, "-")
    want = [(v.LAUNCHING, "", "1"), (v.EXECUTING, "", "1"), cooling, (v.EXECUTING, "", "2"), cooling]
    want += [(v.CLOSING, v.STOPPING, "-"), stopped, (v.LAUNCHING, "", "3"), (v.EXECUTING, "", "3")]
    assert walk[: len(want)] == want and walk[-1] == stopped, walk

    # Costs: the job views equal the instance's billed history, and what the timelines say: each job paid the
    # seconds it held the machine; the job that started it (the launch, the restart) also paid that start's
    # 60 s minimum and rounding; the warm reuse paid only its seconds.
    jobs = {j.job_id: j for j in client.jobs()}
    billed = instance_cost(from_view(inst.model_dump()), time.time())
    per_s = OD_PRICE / 3600
    for job in (first, second, third):
        cost = jobs[job.job_id].cost
        assert cost > 0 and cost == pytest.approx(billed.by_job[job.job_id], abs=1e-6), (job.job_id, cost)
    launches = [h[2] for h in inst.history if h[0] == v.LAUNCHING]
    stops = [h[2] for h in inst.history if h[0] == v.CLOSING]
    extra = [billed_seconds(stop - start) - (stop - start) for start, stop in zip(launches, stops)]
    slack = 3 * per_s  # the timeline's and the instance's timestamps are taken a few ms apart
    for job, started in ((first, extra[0]), (second, 0.0), (third, extra[1])):
        want = (_held_s(jobs[job.job_id]) + started) * per_s
        assert jobs[job.job_id].cost == pytest.approx(want, abs=slack), (job.description, want)
    assert billed.cooling_cost > 0 and inst.cost == pytest.approx(billed.cost, abs=1e-6)
    assert inst.cost == pytest.approx(sum(jobs[j].cost for j in ids if j) + billed.cooling_cost, abs=1e-5)
    answered = client.terminate(first.instance_id)  # a stopped machine goes for good, its cost kept
    assert answered.cost == pytest.approx(inst.cost, abs=1e-6)
    assert (answered.status, answered.substatus) == (v.CLOSED, v.TERMINATED)

    res = run_cell(played["kernel"], "%cloud_timeline", timeout=120)
    assert not res.error, res.error
    lines = res.stdout.splitlines()
    head = lines[0]
    for column in ("REQUESTING", "CONNECTING", "GEARING UP", "SENDING", "TRAINING", "gear-up", "cost $"):
        assert column in head, head
    for job in (first, second, third):
        row = next(line for line in lines if line.startswith(job.job_id))
        cells = row.split()
        assert cells[-1] == f"{jobs[job.job_id].cost:.4f}", (row, jobs[job.job_id].cost)
        connecting = float(cells[4].rstrip("s"))
        assert connecting >= 0 and float(cells[-2].rstrip("s")) >= connecting, row
