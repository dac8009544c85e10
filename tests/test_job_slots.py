"""The per-user active-job limit on a backend of its own (limit 1): a job over it fails at once naming the fix,
or, with wait_new_job_create_s, waits for a slot and starts when the running job ends."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aibro_core import vocabulary as v
from aibro_core.errors import ApiError
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import aibro_cli, slow_data, wait_for


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return aibro_cli(home, *args, AIBRO_MAX_ACTIVE_JOBS="1")  # the daemon it starts inherits the limit


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    home = tmp_path_factory.mktemp("limited") / "aibro"
    started = _cli(home, "backend", "start")
    assert started.returncode == 0, started.stderr[-2000:]
    info = json.loads((home / "backend.json").read_text())
    token = json.loads((home / "credentials.json").read_text())["token"]
    client = BackendClient(info["url"], token)
    assert client.policy().max_active_jobs == 1
    yield client
    _cli(home, "backend", "stop")


def _final(events: list[dict]) -> bool:
    return any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in events)


def test_at_the_limit_a_job_fails_clearly_or_waits_for_a_slot(
    limited: BackendClient, capfd: pytest.CaptureFixture
) -> None:
    x, y = slow_data(3000)
    trainer = Training(limited)
    first = trainer.submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=3, batch_size=16)).job_id
    with pytest.raises(ApiError) as err:
        trainer.submit(FitRequest(make_model(1), x[:200], y[:200], machine_ids="local-cpu", epochs=1))
    assert err.value.status == 429
    assert "the limit is 1" in str(err.value) and "--wait-slot" in str(err.value)
    assert [j.job_id for j in limited.jobs()] == [first], "the refused job was not created"

    second = trainer.submit(
        FitRequest(
            make_model(1),
            x[:200],
            y[:200],
            machine_ids="local-cpu",
            epochs=1,
            wait_new_job_create_s=600,
            wait_new_job_create_interval=0.5,
        ),
    ).job_id
    assert "waiting for a job slot" in capfd.readouterr().err
    first_job = limited.job(first)
    assert first_job.status == v.COMPLETED, "the slot opened when the first job ended"
    assert limited.job(second).created >= first_job.timeline[-1].ts
    wait_for(limited, second, _final)
    assert limited.job(second).status == v.COMPLETED
