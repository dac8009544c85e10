"""Progress and jobs survive the death of the client, the worker and the backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from aibro_core import vocabulary as v
from aibro_jupyter import Training, config
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import backend_db, epochs_seen, instance_pid, slow_data, wait_for

CLIENT_A = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from conftest import make_model
    from helpers import slow_data
    from aibro_jupyter import Training
    x, y = slow_data(3000)
    Training.online_fit(make_model(), x, y, machine_ids="local-cpu", batch_size=16, epochs={epochs},
                        validation_data=(x[:500], y[:500]), cool_down_period_s=600)
    """
)


def _final(evs: list[dict]) -> bool:
    return any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs)


def test_client_killed_then_another_process_attaches(client: BackendClient, capsys: pytest.CaptureFixture) -> None:
    epochs = 6
    script = CLIENT_A.format(tests=str(Path(__file__).parent), epochs=epochs)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    job_id = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if job_id is None and "submitted to" in line:
            job_id = line.split("]")[0].lstrip("[")
        if line.startswith("Epoch 2/"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert job_id, lines
    assert client.job(job_id).status in v.JOB_ACTIVE, "the job must outlive its client"

    capsys.readouterr()
    model = make_model(7)
    trained, history = Training.attach(job_id, model)
    out = capsys.readouterr().out
    for k in range(1, epochs + 1):
        assert out.count(f"Epoch {k}/{epochs} ") == 1, out
    assert trained is model and history.epoch == list(range(epochs))
    x, y = slow_data(3000)
    _, acc = model.evaluate(x[:500], y[:500], verbose=0)
    assert acc == pytest.approx(history.history["val_accuracy"][-1], abs=1e-4)


def test_worker_killed_resumes_from_checkpoint(client: BackendClient, aibro_home: Path) -> None:
    x, y = slow_data(3000)
    epochs = 6
    job = Training(client).submit(
        FitRequest(
            make_model(),
            x,
            y,
            machine_ids="local-cpu",
            batch_size=16,
            epochs=epochs,
            validation_data=(x[:500], y[:500]),
            cool_down_period_s=600,
        ),
    )
    job_id = job.job_id
    wait_for(client, job_id, lambda evs: len(epochs_seen(evs)) >= 2)
    first_instance = client.job(job_id).instance_id
    os.killpg(instance_pid(aibro_home, first_instance), signal.SIGKILL)
    events = wait_for(client, job_id, _final, timeout=400)
    final = client.job(job_id)
    assert final.status == v.COMPLETED, events[-5:]
    assert epochs_seen(events) == list(range(epochs)), "every epoch exactly once, in order"
    assert final.attempt == 1 and final.instance_id != first_instance
    resumed = [e["data"]["message"] for e in events if e["type"] == "log" and "resuming from" in e["data"]["message"]]
    assert resumed, "the resume is logged"
    history = Training.job_history(job_id)
    assert history["epoch"] == list(range(epochs))
    assert all(val is not None for val in history["history"]["loss"])
    model, hist = Training(client).collect(Training(client).watch(job_id))
    assert hist.epoch == list(range(epochs))
    # continuity: Adam's step count covers every epoch exactly once
    assert int(model.optimizer.iterations.numpy()) == int(np.ceil(3000 / 16)) * epochs


def test_backend_killed_and_restarted_loses_nothing(client: BackendClient, aibro_home: Path) -> None:
    x, y = slow_data(3000)
    epochs = 6
    job = Training(client).submit(
        FitRequest(make_model(), x, y, machine_ids="local-cpu", batch_size=16, epochs=epochs, cool_down_period_s=600)
    )
    job_id = job.job_id
    wait_for(client, job_id, lambda evs: len(epochs_seen(evs)) >= 2)
    info = json.loads((aibro_home / "backend.json").read_text())
    os.kill(info["pid"], signal.SIGKILL)
    killed_at = time.time()
    time.sleep(3)  # the worker keeps training and buffers its events meanwhile
    target = config.resolve()
    back_at = time.time()
    assert target.url == client.url, "the backend comes back on the same port, so workers find it"
    assert json.loads((aibro_home / "backend.json").read_text())["pid"] != info["pid"]
    events = wait_for(client, job_id, _final, timeout=400)
    assert client.job(job_id).status == v.COMPLETED, events[-5:]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert epochs_seen(events) == list(range(epochs))
    statuses = [(e["data"]["status"], e["data"]["substatus"]) for e in events if e["type"] == "status"]
    assert len(statuses) == len(set(statuses)), f"no status event is duplicated: {statuses}"
    # every event the worker numbered reached the log once, those it made while the backend was down included
    rows = backend_db(
        aibro_home, "SELECT attempt, wseq, ts FROM events WHERE job_id=? AND wseq IS NOT NULL ORDER BY gid", job_id
    )
    assert {r[0] for r in rows} == {0}
    assert [r[1] for r in rows] == list(range(1, len(rows) + 1))
    assert any(killed_at < r[2] < back_at for r in rows), "the worker kept producing events with the backend down"
