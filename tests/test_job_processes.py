"""Nothing a job starts outlives it (issue 24 item 2), replayed from the user's side: a custom layer, when the worker
builds it, starts a detached child (its own session, as a daemon would) and a TCP listener. When the job completes,
when it is canceled, and when its instance closes, none of them is left running on the host."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import keras
import pytest
from backend_proc import own_backend
from spawner_layer import Spawner

from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import slow_data, wait_for


def marked(marker: str) -> list[int]:
    """Processes on this host whose command line carries the marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def spawning_model(marker: str) -> keras.Model:
    inner = make_model()
    model = keras.Sequential([keras.Input((64,)), Spawner(marker), *inner.layers])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def gone(marker: str, within_s: float = 120) -> bool:
    return _until(lambda: not marked(marker), within_s)


def seen(marker: str, within_s: float = 180) -> bool:
    return _until(lambda: bool(marked(marker)), within_s)


def _until(done: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_completed_job_leaves_no_process_behind(client: BackendClient) -> None:
    marker = f"aibro-orphan-{uuid.uuid4().hex}"
    x, y = slow_data(2000)
    trainer = Training(client)
    job = trainer.submit(
        FitRequest(
            spawning_model(marker), x, y, machine_ids="local-cpu", epochs=2, batch_size=64, cool_down_period_s=600
        )
    )
    assert seen(marker), "the layer's processes never started on the worker (the test proves nothing then)"
    view = trainer.watch(job.job_id)
    assert view.status == "COMPLETED", view.errors
    assert gone(marker), f"still running after the job completed: {marked(marker)}"


def test_a_canceled_job_leaves_no_process_behind(client: BackendClient) -> None:
    marker = f"aibro-orphan-{uuid.uuid4().hex}"
    x, y = slow_data(6000)
    trainer = Training(client)
    job = trainer.submit(
        FitRequest(
            spawning_model(marker), x, y, machine_ids="local-cpu", epochs=500, batch_size=32, cool_down_period_s=600
        )
    )
    assert seen(marker)
    wait_for(client, job.job_id, lambda evs: any(e["type"] == "epoch" for e in evs))
    client.cancel(job.job_id)
    view = trainer.watch(job.job_id)
    assert view.status == "CANCELED"
    assert gone(marker), f"still running after the job was canceled: {marked(marker)}"


def test_a_stopped_backend_leaves_no_process_of_a_running_job_behind(tmp_path: Path) -> None:
    marker = f"aibro-orphan-{uuid.uuid4().hex}"
    x, y = slow_data(6000)
    with own_backend(tmp_path / "home") as backend:
        trainer = Training(backend.client())
        job = trainer.submit(
            FitRequest(spawning_model(marker), x, y, machine_ids="local-cpu", epochs=500, batch_size=32)
        )
        assert seen(marker)
        wait_for(backend.client(), job.job_id, lambda evs: any(e["type"] == "epoch" for e in evs))
        backend.proc.send_signal(signal.SIGTERM)  # `aibro backend stop`: a clean stop
        backend.proc.wait(timeout=120)
        assert gone(marker), f"still running after the backend stopped: {marked(marker)}"


@pytest.fixture(autouse=True)
def _no_leftovers() -> Any:
    yield
    for entry in Path("/proc").iterdir():  # whatever a failed run left: never let it outlive the test either
        if entry.name.isdigit():
            try:
                if b"aibro-orphan-" in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), 9)
            except OSError:
                continue
