"""Quiet, useful backend logs: a user's normal session (uploads, a training job, its events and result, a few
mistakes the client is told about) leaves no WARNING or ERROR line in backend.log; a refused token does. The same
collector (tests/conftest.py) reads every backend log the whole test session wrote."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
from backend_proc import own_backend

from aibro_jupyter.errors import AibroError
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.training import Training

from conftest import backend_logs, make_model, unexpected_log_lines


def test_the_collector_reports_what_no_test_expected() -> None:
    with tempfile.TemporaryDirectory() as d:  # outside the session's directory, which the collector itself reads
        _check_collector(Path(d))


def _check_collector(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    log.write_text(
        "2026-11-23 17:00:00,001 aibro.backend INFO aibro backend listening on http://127.0.0.1:1 (home h)\n"
        "2026-11-23 17:00:01,002 tornado.access WARNING 401 GET /api/v1/jobs (127.0.0.1) 0.2ms refused\n"
        "2026-11-23 17:00:02,003 aibro.scheduler ERROR cannot schedule job-1\n"
        "Traceback (most recent call last):\n"
        "2026-11-23 17:00:03,004 aibro.backend INFO all fine\n"
    )
    (tmp_path / "other.log").write_text("2026-11-23 17:00:02,003 aibro.worker ERROR not a backend's log\n")
    assert backend_logs(tmp_path) == [log]
    found = unexpected_log_lines([log], [r"WARNING 401 .* refused"])
    assert found == [f"{log}: 2026-11-23 17:00:02,003 aibro.scheduler ERROR cannot schedule job-1"]
    assert unexpected_log_lines([log], [r"WARNING 401", r"aibro\.scheduler ERROR"]) == []


@pytest.mark.backend_log(r"tornado\.access WARNING 401 GET /api/v1/health .* refused")
@pytest.mark.timeout(600)
def test_a_normal_session_logs_nothing_to_act_on_and_a_refused_token_is_a_warning(tmp_path: Path, digits) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    with own_backend(tmp_path / "home") as backend:
        client = backend.client()
        trainer = Training(client)
        client.machines()
        job = trainer.submit(
            FitRequest(make_model(), x[:300], y[:300], machine_ids="local-cpu", epochs=2, batch_size=50,
            validation_data=(xv, yv), description="quiet", cool_down_period_s=0),
        )  # fmt: skip
        view = trainer.watch(job.job_id)
        trainer.collect(view, make_model())
        client.jobs()
        client.events(job.job_id)
        again = trainer.submit(  # the same data again: its blobs are already there (HEADs answered 200)
            FitRequest(
                make_model(), x[:300], y[:300], machine_ids="local-cpu", epochs=1, batch_size=50, cool_down_period_s=0
            )
        )
        assert trainer.watch(again.job_id).status == "COMPLETED"
        for mistake in (  # each answered to the client with the problem named: nothing for the backend to say
            lambda: client.job("job-does-not-exist"),
            lambda: client.cancel("job-does-not-exist"),
            lambda: trainer.submit(FitRequest(make_model(), x[:10], y[:10], machine_ids="no-such-machine")),
        ):
            with pytest.raises(AibroError):
                mistake()
        quiet = unexpected_log_lines([backend.log], [])
        assert quiet == [], "\n".join(quiet)

        with pytest.raises(AibroError):
            backend.client("aibro_u_not-a-token").health()
        deadline = time.monotonic() + 30  # the access line is written once the answer is sent: it may trail it
        while True:
            lines = [line.split(" ", 2)[2] for line in backend.log.read_text().splitlines() if " WARNING " in line]
            if lines or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(lines) == 1 and lines[0].startswith("tornado.access WARNING 401 GET /api/v1/health"), lines
