"""Issue 11 item 7: a spot machine that AWS reclaims. The agent polls IMDSv2 (`spot/instance-action`, and the
rebalance recommendation); on the two-minute notice it stops at the next batch boundary, drops the part of the
epoch it was in (every finished epoch is already checkpointed), reports `spot_interrupted` and exits; the backend
terminates the machine and resumes the job on a new one from the last epoch checkpoint, not counting it as a crash.
Here a fake IMDS server per played instance is flipped by the test, then the machine is terminated on moto."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kernel_helpers
import numpy as np
import pytest
import requests
from fake_imds import FakeImds

from aibro_backend.worker.spot import INSTANCE_ACTION, SpotWatch, spot_watch_from_env
from aibro_core import vocabulary as v
from aibro_jupyter.fitrequest import FitRequest


def test_the_watch_speaks_imdsv2_and_sets_its_notice_only_on_an_interruption() -> None:
    rebalances: list[dict[str, Any]] = []
    with FakeImds() as imds:
        assert requests.get(imds.url + INSTANCE_ACTION, timeout=5).status_code == 401, "IMDSv2: token required"
        watch = SpotWatch(imds.url, interval_s=0.05, on_rebalance=rebalances.append)
        assert watch.check() is False and not watch.notice.is_set(), "404: no notice yet"
        assert imds.reads and imds.refused == 1, "the watch read with a session token"

        imds.recommend_rebalance()
        assert watch.check() is False, "a rebalance recommendation is only a warning"
        assert rebalances == [{"noticeTime": "2026-11-23T17:50:00Z"}]

        imds.expire_tokens()  # a token that expired: 401, a new one is fetched
        imds.announce("terminate", "2026-11-23T18:02:00Z")
        assert watch.check() is True and watch.notice.is_set()
        assert watch.detail == {"action": "terminate", "time": "2026-11-23T18:02:00Z"}
        assert "terminate at 2026-11-23T18:02:00Z" in watch.describe()
        assert len(rebalances) == 1, "reported once"


def test_the_watch_polls_on_its_own_thread_and_only_on_spot_machines() -> None:
    assert spot_watch_from_env({}) is None, "off on local workers and on-demand machines"
    with FakeImds() as imds:
        watch = spot_watch_from_env({"AIBRO_SPOT_WATCH": "1", "AIBRO_IMDS_URL": imds.url, "AIBRO_SPOT_POLL_S": "0.05"})
        assert watch is not None
        try:
            time.sleep(0.3)
            assert not watch.notice.is_set()
            imds.announce()
            assert watch.notice.wait(30), "the notice is seen within a few polls"
        finally:
            watch.stop()
    unreachable = SpotWatch("http://127.0.0.1:9", interval_s=0.05)
    assert unreachable.check() is False, "IMDS out of reach is logged, never raised into training"


# -- end to end through moto --------------------------------------------------------------------------------------
import boto3  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)


@pytest.fixture(scope="module")
def moto() -> Iterator[dict[str, Any]]:
    from aws_moto import make_account, moto_server

    with moto_server() as env:
        yield {"env": env, "account": make_account()}


@pytest.fixture
def spot_backend(moto: dict, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A backend with the AWS provider, its played instances, and one fake IMDS per played instance."""
    from aws_moto import PlayedInstances, write_config
    from backend_proc import own_backend

    from aibro_backend.providers.aws_config import load_aws_config

    from helpers import backend_db

    imds: dict[str, FakeImds] = {}
    home = tmp_path / "home"

    def an_epoch_ended() -> bool:
        return bool(backend_db(home, "SELECT 1 FROM events WHERE type='epoch' LIMIT 1"))

    def machine_env(ec2_id: str) -> dict[str, str]:
        # AWS's notice reaches the first machine once its first epoch is stored (its second is running); the
        # machine reads it within a poll, while epochs are left to cut, however slow the box or the test
        imds[ec2_id] = FakeImds(notice_when=an_epoch_ended if not imds else None).__enter__()
        return {"AIBRO_IMDS_URL": imds[ec2_id].url, "AIBRO_SPOT_POLL_S": "0.2"}

    config = write_config(tmp_path / "spot.toml", moto["account"])
    backend_id = load_aws_config(config).backend_id
    try:
        with own_backend(home, "--provider", "aws", "--aws-config", str(config), **moto["env"]) as b:
            with PlayedInstances(backend_id, b.url, tmp_path / "machines", moto["env"], machine_env) as played:
                yield {"backend": b, "played": played, "imds": imds}
    finally:
        for fake in imds.values():
            fake.__exit__()


def _final(events: list[dict[str, Any]]) -> bool:
    return any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in events)


def test_a_reclaimed_spot_machine_resumes_on_a_new_one_with_every_epoch_once(
    spot_backend: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aws_moto import REGION

    from aibro_jupyter import Training

    from conftest import make_model
    from helpers import epochs_seen, slow_data, wait_for

    b, played = spot_backend["backend"], spot_backend["played"]
    monkeypatch.setenv("AIBRO_BACKEND_URL", b.url)
    monkeypatch.setenv("AIBRO_TOKEN", b.token)
    client = b.client()
    n, batch, epochs = 8000, 16, 4
    x, y = slow_data(n)
    job = Training(client).submit(
        FitRequest(
            make_model(),
            x,
            y,
            machine_ids="g4dn.xlarge",
            batch_size=batch,
            epochs=epochs,
            validation_data=(x[:500], y[:500]),
        ),
    )
    job_id = job.job_id
    # Mid-way through epoch 1 (its batches are running): AWS gives its two-minute notice (the fixture's fake IMDS).
    events = wait_for(
        client, job_id, lambda evs: any(e["type"] == "log" and "spot_interrupted" in e["data"] for e in evs), 600
    )
    ec2_first = next(iter(played.envs))  # the first machine booted
    assert played.envs[ec2_first]["AIBRO_SPOT_WATCH"] == "1", "the spot machine's user data turns the watch on"
    first = min(client.instances(), key=lambda i: i.created)
    assert first.machine_id == "g4dn.xlarge" and first.job_id in (job_id, None), first
    assert "AWS announced a spot interruption (terminate at" in played.log(ec2_first)
    agent = played.procs.get(ec2_first)
    if agent is not None:  # it exits by itself, unless the harness saw its machine terminated (by the backend) first
        assert agent.wait(timeout=60) in (0, -9)
    ec2 = boto3.Session(region_name=REGION).client("ec2")
    ec2.terminate_instances(InstanceIds=[ec2_first])  # what AWS does two minutes after its notice

    events = wait_for(client, job_id, _final, timeout=600)
    final = client.job(job_id)
    said = [e["data"] for e in events if e["type"] in ("log", "error")]
    assert final.status == v.COMPLETED, said[-6:]
    assert epochs_seen(events) == list(range(epochs)), "every epoch exactly once, in order"
    assert final.attempt == 1, "one attempt more"
    assert final.instance_id != first.id and final.machine_id == "g4dn.xlarge", "the same type again"
    assert len(played.envs) == 2 and ec2_first in played.envs

    reported = [e for e in events if e["type"] == "log" and "spot_interrupted" in e["data"]]
    assert len(reported) == 1 and "AWS announced a spot interruption (terminate at" in reported[0]["data"]["message"]
    messages = [e["data"].get("message", "") for e in events if e["type"] == "status"]
    resumed = [m for m in messages if m.startswith("spot machine g4dn.xlarge was reclaimed by AWS; resuming from")]
    assert resumed and resumed[0].endswith("on g4dn.xlarge"), messages
    k = int(resumed[0].split("resuming from epoch ")[1].split()[0])
    assert 1 <= k < epochs, resumed  # epoch 1 stopped part-way (a loaded box may have reached a later one)
    before = [e["data"]["epoch"] for e in events if e["type"] == "epoch" and e["seq"] < reported[0]["seq"]]
    assert before == list(range(k)), (before, k)

    instances = {i.id: i for i in client.instances()}
    gone = instances[first.id]
    assert (gone.status, gone.substatus) in ((v.CLOSING, v.TERMINATING), (v.CLOSED, v.TERMINATED)), gone
    state = ec2.describe_instances(InstanceIds=[ec2_first])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated")

    history = Training.job_history(job_id)
    assert history["epoch"] == list(range(epochs)) and all(val is not None for val in history["history"]["loss"])
    model, hist = Training(client).collect(Training(client).watch(job_id, []))
    assert hist.epoch == list(range(epochs))
    # continuity: the resumed attempt started from the last epoch checkpoint, the dropped part-epoch left no trace:
    # Adam's step count covers every epoch exactly once
    assert int(model.optimizer.iterations.numpy()) == int(np.ceil(n / batch)) * epochs


SPOT_CELL = """%%cloud_fit --machine g4dn.xlarge,g4dn.xlarge.od --description "spot in a kernel"
model = build()
history = model.fit(x_train, y_train, epochs=4, batch_size=16, validation_data=(x_val, y_val))
acc = model.evaluate(x_val, y_val, verbose=0)[1]
print("FINAL", round(acc, 4), round(history.history["val_accuracy"][-1], 4), len(history.history["loss"]))
"""
KERNEL_SETUP = kernel_helpers.digits_setup(tile=8)  # epochs long enough to be cut part-way


def test_a_spot_cloud_fit_cell_in_a_kernel_is_interrupted_and_resumes_on_the_next_machine(
    spot_backend: dict, tmp_path: Path
) -> None:
    """Issue 11 item 11's "a spot job is interrupted and resumes": a `%%cloud_fit --machine
    g4dn.xlarge,g4dn.xlarge.od` cell trains on a played spot machine; AWS's notice comes mid-epoch; the cell goes on
    by itself on the next machine in its list (on-demand), shows every epoch once, and the trained model comes back
    into `model`."""
    import re

    from aws_moto import REGION
    from kernel_helpers import drain, run_cell, start_kernel

    from helpers import wait_for

    b, played = spot_backend["backend"], spot_backend["played"]
    client = b.client()
    km, kc = start_kernel(
        {"AIBRO_HOME": str(tmp_path / "kernel-home"), "AIBRO_BACKEND_URL": b.url, "AIBRO_TOKEN": b.token}
    )
    try:
        setup = run_cell(kc, KERNEL_SETUP, timeout=300)
        assert not setup.error, setup.error
        res = run_cell(kc, SPOT_CELL, timeout=600, until="Epoch 1/4")  # epoch 0 ended: AWS's notice comes now
        ec2_first = next(iter(played.envs))
        job = next(j for j in client.jobs() if j.description == "spot in a kernel")
        wait_for(
            client, job.job_id, lambda evs: any(e["type"] == "log" and "spot_interrupted" in e["data"] for e in evs)
        )
        boto3.Session(region_name=REGION).client("ec2").terminate_instances(InstanceIds=[ec2_first])
        res = drain(kc, res, timeout=600)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not res.error, res.error + res.stdout[-3000:]
    for k in range(1, 5):
        assert len(re.findall(rf"Epoch {k}/4\b", res.stdout)) == 1, res.stdout
    final = re.search(r"FINAL (\S+) (\S+) (\d+)", res.stdout)
    assert final and final.group(1) == final.group(2) and final.group(3) == "4", res.stdout
    done = client.job(job.job_id)
    assert done.status == v.COMPLETED and done.machine_id == "g4dn.xlarge.od", done
    assert len(played.envs) == 2
    events = client.events(job.job_id)["events"]
    said = [e["data"].get("message", "") for e in events if e["type"] == "status"]
    assert any(m.startswith("spot machine g4dn.xlarge was reclaimed by AWS; resuming from epoch") for m in said), said
