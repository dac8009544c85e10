"""End to end on the embedded backend: online_fit, events, artifacts, warm reuse, cancel, replay."""

from __future__ import annotations

import inspect
import json
import os
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from aibro_backend.providers.local import pid_alive
from aibro_core import vocabulary as v
from aibro_core.models import Job
from aibro_jupyter import Training, bundle
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.kerasnames import plan_names

from conftest import make_model
from helpers import slow_data, wait_for

EPOCHS = 4


SEED_SIGNATURE = [
    "model", "train_X", "train_Y", "machine_ids", "batch_size", "epochs", "validation_data", "description",
    "cool_down_period_s", "fit_kwargs", "directory_to_save_ckpt", "directory_to_save_log", "wait_request_s",
    "wait_new_job_create_s", "wait_new_job_create_interval", "record",
]  # fmt: skip


@pytest.fixture(scope="module")
def first_job(client: BackendClient, digits, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001
    x, y, xv, yv = digits
    for inst in client.instances():  # start from a cold machine so gear-up can be compared with a warm one
        if inst.status == v.COOLING:
            client.terminate(inst.id)
    model = make_model()
    before = [w.copy() for w in model.get_weights()]
    out = tmp_path_factory.mktemp("first-job")
    job_id, trained, history = Training.online_fit(
        model,
        x,
        y,
        machine_ids="local-cpu",
        batch_size=32,
        epochs=EPOCHS,
        validation_data=(xv, yv),
        description="e2e digits",
        cool_down_period_s=600,
        fit_kwargs={"shuffle": False},
        directory_to_save_ckpt=str(out / "ckpt"),
        directory_to_save_log=str(out / "tb"),
    )
    return {
        "job_id": job_id,
        "model": model,
        "trained": trained,
        "history": history,
        "before": before,
        "data": digits,
        "out": out,
    }


def test_online_fit_keeps_the_seed_signature() -> None:
    params = list(inspect.signature(Training.online_fit).parameters)
    assert params[: len(SEED_SIGNATURE)] == SEED_SIGNATURE


def test_online_fit_saves_checkpoints_and_logs_where_asked(first_job) -> None:  # noqa: ANN001
    job_id, out = first_job["job_id"], first_job["out"]
    ckpts = sorted(p.name for p in (out / "ckpt" / job_id / "checkpoints").iterdir())
    assert ckpts == [f"epoch-{k:04d}.keras" for k in range(1, EPOCHS + 1)]
    assert list((out / "tb" / "logs" / job_id).rglob("events.out.tfevents.*")), "TensorBoard logs"
    # Each loads; the last holds exactly the model that came back, optimizer state included (the worker writes
    # checkpoints after the first straight from its weights snapshot: they must be what Keras would have saved).
    model = first_job["model"]
    for name in ckpts:
        loaded = keras.saving.load_model(out / "ckpt" / job_id / "checkpoints" / name)
    for got, want in zip(loaded.weights + loaded.optimizer.variables, model.weights + model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) > 0


def test_online_fit_returns_the_same_model_trained(first_job) -> None:  # noqa: ANN001
    model, trained, history = first_job["model"], first_job["trained"], first_job["history"]
    assert trained is model
    assert any(not np.allclose(a, b) for a, b in zip(first_job["before"], model.get_weights()))
    assert history.epoch == list(range(EPOCHS))
    assert set(history.history) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    _, _, xv, yv = first_job["data"]
    loss, acc = model.evaluate(xv, yv, verbose=0)
    assert acc == pytest.approx(history.history["val_accuracy"][-1], abs=1e-4)
    assert loss == pytest.approx(history.history["val_loss"][-1], rel=1e-3)
    assert acc > 0.8
    # optimizer state came back too: Adam's iteration count equals the steps trained remotely
    steps = int(np.ceil(len(first_job["data"][0]) / 32)) * EPOCHS
    assert int(model.optimizer.iterations.numpy()) == steps


def test_online_fit_prints_progress(client: BackendClient, digits, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    Training.online_fit(
        make_model(1),
        x[:300],
        y[:300],
        machine_ids="local-cpu",
        epochs=2,
        validation_data=(xv, yv),
        cool_down_period_s=600,
    )
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "val_accuracy" in out
    assert "TRAINING · TRAINING" in out and "COMPLETED · COMPLETED" in out


def test_states_and_events(client: BackendClient, first_job) -> None:  # noqa: ANN001
    job = client.job(first_job["job_id"])
    assert job.status == v.COMPLETED and job.epochs_done == EPOCHS
    events = client.events(first_job["job_id"])["events"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "seq must be gap-free"
    status_events = [e["data"] for e in events if e["type"] == "status"]
    walked = [d["substatus"] for d in status_events]
    assert list(dict.fromkeys(walked)) == list(v.SUBSTATUS_ORDER), walked  # each once, in the vocabulary's order
    statuses = [d["status"] for d in status_events]
    assert list(dict.fromkeys(statuses)) == [v.QUEUING, v.TRAINING, v.COMPLETED], statuses
    ts = [t.ts for t in job.timeline]
    assert ts == sorted(ts)
    epoch_events = [e["data"] for e in events if e["type"] == "epoch"]
    assert [d["epoch"] for d in epoch_events] == list(range(EPOCHS))
    for d in epoch_events:
        assert set(d["logs"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        assert d["seconds"] > 0 and d["samples_per_s"] > 0
    batch_ts = [e["ts"] for e in events if e["type"] == "batch"]
    assert batch_ts, "batch events are expected"
    assert all(b - a >= 0.2 for a, b in zip(batch_ts, batch_ts[1:])), "batch events must be throttled"


def test_artifacts_and_tensorboard_logs(client: BackendClient, first_job, tmp_path: Path) -> None:  # noqa: ANN001
    job_id = first_job["job_id"]
    names = {a.name for a in client.artifacts(job_id)}
    assert {"model.keras", "history.json"} <= names
    assert {f"checkpoints/epoch-{i:04d}.keras" for i in range(1, EPOCHS + 1)} <= names
    assert any(n.startswith("tensorboard/train/events.out.tfevents") for n in names)
    history = Training.job_history(job_id)
    assert history["epoch"] == list(range(EPOCHS))
    assert history["history"]["val_accuracy"] == pytest.approx(first_job["history"].history["val_accuracy"])
    dest = Training.get_tensorboard_logs(job_id, str(tmp_path))
    assert dest == tmp_path / "logs" / job_id
    assert list((dest / "train").glob("events.out.tfevents*")) and list((dest / "validation").glob("events.*"))


def test_second_job_reuses_the_warm_worker(client: BackendClient, first_job, digits) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    first = client.job(first_job["job_id"])
    before = client.counters().get("blob_bytes_received", 0)
    model = make_model()
    probe = bundle.new_bundle()
    bundle.save_model(model, probe, plan_names(model))
    model_bytes = (probe.workdir / "model.keras").stat().st_size
    job = Training(client).submit(FitRequest(model, x, y, machine_ids="local-cpu", epochs=1, cool_down_period_s=600))
    Training(client).watch(job.job_id)
    second = client.job(job.job_id)
    assert second.status == v.COMPLETED
    assert second.instance_id == first.instance_id, "a warm instance of the same machine must be reused"

    def gear_up(j: Job) -> float:
        t = {s.substatus: s.ts for s in j.timeline}
        return t[v.SENDING_MODEL_DATA] - t[v.GEARING_UP_ENV]

    print(f"gear-up: cold {gear_up(first):.3f}s, warm {gear_up(second):.3f}s")
    # the data is already there: only the new (untrained) model's bytes travel
    assert client.counters().get("blob_bytes_received", 0) - before == model_bytes
    inst = next(i for i in client.instances() if i.id == second.instance_id)
    states = [h[0] for h in inst.history]
    assert states[:4] == [v.LAUNCHING, v.EXECUTING, v.COOLING, v.EXECUTING]
    assert inst.status == v.COOLING and inst.cooling_left_s > 0


def test_events_long_poll(client: BackendClient, first_job) -> None:  # noqa: ANN001
    """`wait` holds a request only while nothing is after `after` and more can come; what is there returns at once."""
    job_id = first_job["job_id"]
    t0 = time.monotonic()
    page = client.events(job_id, 0, wait=60)
    assert page["events"] and time.monotonic() - t0 < 30
    last = page["events"][-1]["seq"]
    assert [e["seq"] for e in client.events(job_id, last - 3)["events"]] == [last - 2, last - 1, last]
    t0 = time.monotonic()
    page = client.events(job_id, last, wait=60)
    assert page["events"] == [] and page["status"] == v.COMPLETED
    assert time.monotonic() - t0 < 30, "a final job has nothing more to wait for"
    cursor = client.user_events(0)["cursor"]
    t0 = time.monotonic()
    page = client.user_events(cursor, wait=2)
    assert page["events"] == [] and page["cursor"] == cursor
    assert time.monotonic() - t0 >= 1.9, "an empty long-poll waits for its whole `wait`"


def test_events_long_poll_returns_when_an_event_arrives(client: BackendClient, digits) -> None:  # noqa: ANN001
    x, y = digits[0][:64], digits[1][:64]
    job_id = (
        Training(client)
        .submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, cool_down_period_s=600))
        .job_id
    )
    seen = 0
    waits = []
    while True:
        t0 = time.monotonic()
        page = client.events(job_id, seen, wait=60)
        waits.append(time.monotonic() - t0)
        assert page["events"], "a long-poll returns events, or waits its whole `wait`"
        seen = page["events"][-1]["seq"]
        if any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in page["events"]):
            break
    assert max(waits) < 45, waits  # each wait ended because an event arrived, not because 60 s ran out


def test_cancel_stops_within_about_a_batch(client: BackendClient) -> None:
    x, y = slow_data(n=40000)  # one epoch is ~2500 batches, several seconds: a stop at epoch end would show
    job = Training(client).submit(
        FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=50, batch_size=16, cool_down_period_s=600)
    )
    job_id = job.job_id
    events = wait_for(client, job_id, lambda evs: any(e["type"] == "batch" for e in evs))
    client.cancel(job_id)
    events = wait_for(
        client, job_id, lambda evs: any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs)
    )
    final = client.job(job_id)
    assert final.status == v.CANCELED and final.epochs_done == 0
    cancel_at = next(e["ts"] for e in events if e["type"] == "log" and e["data"]["message"] == "cancel requested")
    assert not [e for e in events if e["type"] == "epoch"], "the first epoch must not finish"
    batches = [e["data"] for e in events if e["type"] == "batch"]
    assert all(b["epoch"] == 0 for b in batches)
    assert batches[-1]["batch"] < batches[-1]["steps"] // 2, "training stopped mid-epoch"
    # the worker hears of the cancel within its heartbeat and stops at the next batch boundary
    batches_after = [e for e in events if e["type"] == "batch" and e["ts"] > cancel_at]
    assert len(batches_after) <= 6, batches_after
    done_at = next(e["ts"] for e in events if e["type"] == "status" and e["data"]["status"] == v.CANCELED)
    assert done_at - cancel_at < 15
    # the instance is healthy and cooling, ready for the next job
    inst = next(i for i in client.instances() if i.id == final.instance_id)
    assert inst.status == v.COOLING


def test_replay_runs_a_recorded_job_again(client: BackendClient, first_job) -> None:  # noqa: ANN001
    new_id, model, history = Training.replay_job(first_job["job_id"])
    assert new_id != first_job["job_id"]
    assert client.job(new_id).replay_of == first_job["job_id"]
    assert history.epoch == list(range(EPOCHS))
    _, _, xv, yv = first_job["data"]
    _, acc = model.evaluate(xv, yv, verbose=0)
    assert acc == pytest.approx(history.history["val_accuracy"][-1], abs=1e-4)


def test_available_machines_prints_and_returns(client: BackendClient, capsys: pytest.CaptureFixture) -> None:
    offers = Training.available_machines()
    out = capsys.readouterr().out
    cpu = next(o for o in offers if o["machine_id"] == "local-cpu")
    assert cpu["vcpus"] == os.cpu_count() and cpu["price_per_hour"] == 0
    mem_kib = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
    assert cpu["memory_gib"] == pytest.approx(mem_kib / 1024**2, rel=0.05)
    if not tf.config.list_physical_devices("GPU"):
        assert not [o for o in offers if o["gpu_count"]], "a host without a GPU offers no GPU machine"
    assert "local-cpu" in out and "machine_id" in out
    json.dumps(offers)


def test_one_offer_per_gpu_the_host_has(client: BackendClient) -> None:
    found = tf.config.list_physical_devices("GPU")
    if not found:
        pytest.skip("this host has no GPU that TensorFlow sees: there is no GPU offer to check")
    offers = Training.available_machines()
    gpus = [o for o in offers if o["machine_id"].startswith("local-gpu") and o["gpu_count"] == 1]
    assert len(gpus) == len(found), "one offer per GPU the host really has"
    assert all(o["gpu_type"] for o in gpus), gpus


def test_cool_down_expiry_closes_the_instance(client: BackendClient, aibro_home: Path, digits) -> None:  # noqa: ANN001
    from helpers import instance_pid

    x, y, _, _ = digits
    job = Training(client).submit(
        FitRequest(make_model(), x[:200], y[:200], machine_ids="local-cpu", epochs=1, cool_down_period_s=1)
    )
    Training(client).watch(job.job_id)
    inst_id = client.job(job.job_id).instance_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        inst = next(i for i in client.instances() if i.id == inst_id)
        if inst.status == v.CLOSED:
            break
        time.sleep(0.2)
    states = [h[0] for h in inst.history]
    assert states[-3:] == [v.COOLING, v.CLOSING, v.CLOSED], states
    assert inst.substatus == v.TERMINATED
    assert not pid_alive(instance_pid(aibro_home, inst_id)), "the worker process is gone"
