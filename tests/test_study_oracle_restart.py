"""A study's oracle host killed again and again while the study hands out trials (issue 39 item 4, the fault alone):
each kill lands as a trial's job ends, when the backend tells the oracle about it and asks for the next trial, so
some land inside a request (the oracle has saved, or not yet, what it was asked). The backend starts the host
again and the study goes on: it completes with every trial it was allowed, each trial run once (one job, one end)
with a score, and the oracle's own saved state agrees."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import keras_tuner as kt  # noqa: F401  (the test extra has it: missing fails, never skips)
import pytest
from backend_proc import own_backend
from searchmodels import build_model

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.search import follow, given_args, start_study

from helpers import pids_where, slow_data

TRIALS = 6
pytestmark = pytest.mark.backend_log(r"oracle_client WARNING oracle host of \S+ ended \(exit -9\)")


def _oracle_hosts(study_dir: Path) -> list[int]:
    """The pids of the study's oracle host processes."""
    return pids_where(lambda argv: b"aibro_backend.tuning.oracle_host" in argv and str(study_dir).encode() in argv)


def test_a_study_goes_on_while_its_oracle_host_is_killed_again_and_again(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with own_backend(home) as b:
        client = b.client()
        x, y = slow_data(600)
        tuner = kt.RandomSearch(build_model, objective="loss", max_trials=TRIALS, seed=5, directory=str(tmp_path))
        req = FitRequest(None, x, y, machine_ids="local-cpu", epochs=1, batch_size=64, cool_down_period_s=120)
        study_id = start_study(Training(client), tuner, req, parallel=2, verbose=False, search_args=given_args(req))
        study_dir = home / "state" / "studies" / study_id
        kills: list[float] = []
        done = threading.Event()
        rng = random.Random(3)

        def killer() -> None:
            """As each trial's job ends, kill the host 0 to 0.5 s later: around the end_trial and create_trial the
            backend then sends (it steps every 0.25 s)."""
            ended: set[str] = set()
            while not done.wait(0.05):
                study = client.study(study_id)
                fresh = [t.job_id for t in study.trials if t.job_id not in ended and _ended(client, t.job_id)]
                if not fresh:
                    continue
                ended.update(fresh)
                time.sleep(rng.uniform(0, 0.5))
                for pid in _oracle_hosts(study_dir):
                    os.kill(pid, signal.SIGKILL)
                    kills.append(time.monotonic())

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            study = follow(client, study_id, verbose=False)
        finally:
            done.set()
            thread.join(30)

    assert study.status == v.STUDY_COMPLETED, (study.status, study.message)
    assert len(kills) >= 3, f"the host was killed {len(kills)} times"
    trials = study.trials
    assert len(trials) == TRIALS and len({t.trial_id for t in trials}) == TRIALS, [t.trial_id for t in trials]
    assert all(t.status == v.TRIAL_COMPLETED and t.score is not None for t in trials), trials
    assert all(len(t.executions) == 1 for t in trials), "each trial ran once"
    jobs = [e.job_id for t in trials for e in t.executions]
    assert len(set(jobs)) == TRIALS, jobs
    saved = {p.parent.name: json.loads(p.read_text()) for p in (study_dir / "oracle").glob("trial_*/trial.json")}
    assert len(saved) == TRIALS and all(s["status"] == "COMPLETED" for s in saved.values()), {
        k: s["status"] for k, s in saved.items()
    }
    assert {s["trial_id"] for s in saved.values()} == {t.trial_id for t in trials}


def test_a_host_killed_after_saving_an_end_but_before_answering_leaves_that_trial_ended(tmp_path: Path) -> None:
    """The kill between the oracle saving a trial's end and the backend reading the answer: started again and told
    the trial still runs (the backend never heard), the host keeps it ended; the backend's end_trial, sent again,
    hears so (its score with it), and the next trial handed out is a new one."""
    import asyncio

    from aibro_backend.tuning.oracle_client import OracleHost
    from aibro_backend.tuning.oracle_host import OracleRequest
    from aibro_core.models import OracleSpec

    hp = kt.HyperParameters()
    hp.Int("units", 8, 128, step=8)
    spec = OracleSpec(kind="RandomSearch", objective=[{"name": "loss", "direction": "min"}],
                      hyperparameters=hp.get_config(), max_trials=4, seed=1)  # fmt: skip

    async def run() -> None:
        running: dict[str, str] = {}
        host = OracleHost.create(tmp_path / "study", spec, lambda: dict(running))
        first = (await host.ask(OracleRequest(op="create_trial", slot="slot-0"))).trial
        assert first is not None
        running[first.trial_id] = "slot-0"
        end = OracleRequest(op="end_trial", trial_id=first.trial_id, status="COMPLETED", metrics={"loss": 0.5})
        proc = host.proc
        assert proc is not None and proc.stdin is not None
        proc.stdin.write(end.model_dump_json().encode() + b"\n")  # the backend's end_trial, whose answer is lost
        await proc.stdin.drain()
        saved = tmp_path / "study" / "oracle" / f"trial_{first.trial_id}" / "trial.json"
        while _status(saved) != "COMPLETED":
            await asyncio.sleep(0.01)
        proc.kill()
        await proc.wait()
        again = await host.ask(end)  # started again, told the trial runs; the end sent again
        assert not again.ok and "COMPLETED already" in (again.error or ""), again
        assert again.trial is not None and again.trial.score == 0.5
        running.clear()
        second = (await host.ask(OracleRequest(op="create_trial", slot="slot-0"))).trial
        assert second is not None and second.trial_id != first.trial_id, "an ended trial is not handed out again"
        listed = await host.ask(OracleRequest(op="trials"))
        assert [t.status for t in listed.trials] == ["COMPLETED", "RUNNING"]
        await host.close()

    asyncio.run(run())


def _status(trial_json: Path) -> str | None:
    try:
        return json.loads(trial_json.read_text())["status"]
    except (OSError, ValueError, KeyError):
        return None  # being written


def _ended(client: object, job_id: str) -> bool:
    return client.job(job_id).status in v.JOB_FINAL  # type: ignore[attr-defined]
