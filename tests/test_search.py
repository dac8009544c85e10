"""Hyperparameter search from the kernel's API (issue 27 items 1, 2 and 5): a KerasTuner RandomSearch's trials run
as jobs on the embedded backend, two at once, each model built on the worker by the user's build function with the
oracle's values; every trial ends once; the best trial's trained model comes back and scores what its trial did,
and the kernel's tuner answers get_best_hyperparameters(), get_best_models() and results_summary() as after a local
search. Issue 35 item 4, KerasTuner's whole contract: executions_per_trial, HyperModel subclasses with their own
fit, Hyperband rounds over a model with no Input, best models with their optimizer state, kt.Objective, callbacks
and validation_split, and failed trials that say so."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import keras
import keras_tuner as kt  # noqa: F401  (the test extra has it: missing fails, never skips)
import numpy as np
import pytest
from backend_proc import own_backend
from keras_tuner.src.engine import tuner_utils
from searchmodels import (
    CroppedFit,
    LoopFit,
    ScoredFit,
    TunedFit,
    build_model,
    build_model_failing_wide,
    build_model_no_input,
    build_regressor,
    halve,
)

from aibro_core import vocabulary as v
from aibro_core.errors import ApiError
from aibro_core.models import Job, JobSpec, Study
from aibro_jupyter import Training
from aibro_jupyter.client import spec_json
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.search import TrialHistories
from aibro_jupyter.training import uploaded

from helpers import slow_data, wait_until


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with own_backend(tmp_path_factory.mktemp("search") / "home") as b:
        yield b


def test_a_random_search_runs_its_trials_as_jobs_two_at_a_time(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(1200, seed=4)
    xv, yv = slow_data(300, seed=5)
    tuner = kt.RandomSearch(
        build_model, objective="val_accuracy", max_trials=4, seed=7, directory=str(tmp_path), project_name="local"
    )
    followed = TrialHistories(backend.client())  # what the study panel follows, started before the study
    assert followed.since_last(Study.model_construct(trials=[])) == {}
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=2, epochs=2, batch_size=64, validation_data=(xv, yv)
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED", study
    trials = study["trials"]
    assert [t["status"] for t in trials] == ["COMPLETED"] * 4, trials
    assert len({t["job_id"] for t in trials}) == 4 and len({str(t["values"]) for t in trials}) == 4
    jobs = {t["trial_id"]: client.job(t["job_id"]) for t in trials}
    assert all(j.status == v.COMPLETED for j in jobs.values())

    # The panel's loss charts: each trial's epochs read from the user's event stream since before the study, and
    # from one listing after it, are that trial job's own history; nothing new is handed over twice.
    histories = {trial: [r.model_dump() for r in job.history] for trial, job in jobs.items()}
    assert all(len(h) == 2 for h in histories.values()), histories
    assert followed.since_last(Study.model_validate(study)) == histories
    assert TrialHistories(client).since_last(Study.model_validate(study)) == histories
    assert followed.since_last(Study.model_validate(study)) == {}

    # Two at once: some trial's job was on its machine while another's was (local-cpu has capacity 2 here).
    spans = sorted(_training_span(j) for j in jobs.values())
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans

    # The best trial is the one with the best val_accuracy, and its model comes back trained as it was.
    scores = {t["trial_id"]: t["score"] for t in trials}
    assert study["best_trial_id"] == max(scores, key=lambda k: scores[k])
    best_values = next(t["values"] for t in trials if t["trial_id"] == study["best_trial_id"])
    assert best.layers[0].units == best_values["units"]
    _, accuracy = best.evaluate(xv, yv, verbose=0)
    assert accuracy == pytest.approx(jobs[study["best_trial_id"]].history[-1].val_accuracy, abs=1e-4)

    # The kernel's tuner answers as after a local search: get_best_models() gives the best trial's model at its best
    # epoch (KerasTuner's SaveBestEpoch checkpoint), which scores the trial's score.
    assert tuner.get_best_hyperparameters()[0].values == best_values
    reloaded = tuner.get_best_models()[0]
    assert reloaded.evaluate(xv, yv, verbose=0)[1] == pytest.approx(scores[study["best_trial_id"]], abs=1e-4)
    tuner.results_summary()
    summary = capsys.readouterr().out
    assert summary.count("Trial ") >= 4 and f"Trial {study['best_trial_id']} summary" in summary, summary


def test_a_hyperband_study_resumes_each_round_from_the_earlier_trials_weights(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hyperband's later rounds continue an earlier trial (its `tuner/trial_id`): that trial's job starts from the
    earlier trial's checkpoint, at its `tuner/initial_epoch`, as KerasTuner's Hyperband does locally; a model with no
    Input (built on its first call) is built first, so no round fails (issue 35), and the best models load whole."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(1200, seed=4)
    xv, yv = slow_data(300, seed=5)
    tuner = kt.Hyperband(
        build_model_no_input,
        objective="val_accuracy",
        max_epochs=3,
        factor=3,
        seed=2,
        directory=str(tmp_path),
        project_name="hb",
    )
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=2, epochs=3, batch_size=64, validation_data=(xv, yv)
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED" and best is not None, study
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"] * len(study["trials"]), study["trials"]
    by_id = {t["trial_id"]: t for t in study["trials"]}
    resumed = [t for t in study["trials"] if t["values"].get("tuner/trial_id")]
    assert resumed, "a Hyperband study continues some trials in later rounds"
    _assert_best_models_load_whole(tuner)
    for trial in resumed:
        earlier = by_id[trial["values"]["tuner/trial_id"]]
        job, before = client.job(trial["job_id"]), client.job(earlier["job_id"])
        first = job.history[0]
        assert first.epoch == trial["values"]["tuner/initial_epoch"] + 1, job.history  # 1-based
        assert len(job.history) == trial["values"]["tuner/epochs"] - trial["values"]["tuner/initial_epoch"]
        assert job.epochs == trial["values"]["tuner/epochs"]
        said = [e["data"]["message"] for e in client.events(trial["job_id"])["events"] if e["type"] == "log"]
        assert f"starting from the trained weights of trial {earlier['trial_id']} ({earlier['job_id']})" in said
        assert first.loss < before.history[0].loss, ("it starts from the earlier trial's weights", job, before)


def test_a_trial_cannot_start_from_another_users_job(backend: Any, tmp_path: Path) -> None:
    """`resume_job` lets a trial read one earlier job's model, only when that job is of the same user."""
    alice = Training(backend.client())
    x, y = slow_data(200, seed=6)
    theirs = alice.submit(FitRequest(build_model(kt.HyperParameters()), x, y, machine_ids="local-cpu")).job_id
    assert alice.watch(theirs, []).status == v.COMPLETED
    mallory = backend.add_user(f"mallory-{tmp_path.name[-6:]}")
    training = Training(mallory)
    spec = _trial_spec(training, x, y, resume_job=theirs)
    job_id = training.client.submit(spec).job_id
    view = training.watch(job_id, [])
    assert view.status == v.CANCELED and view.errors, "the trial failed"
    assert f"{theirs} is not assigned" in view.errors[-1], view.errors


def _training_span(job: Job) -> tuple[float, float]:
    """From the job's gearing up on its machine to its end, by its timeline (its fit alone can be shorter than a
    gear-up under load, so two jobs on two machines need not fit at the same instant)."""
    start = next(e.ts for e in job.timeline if e.substatus == v.GEARING_UP_ENV and e.ts is not None)
    return start, max(e.ts for e in job.timeline if e.ts is not None)


def test_a_failing_trial_is_recorded_and_the_study_goes_on(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(300, seed=4)
    tuner = kt.RandomSearch(
        build_model_failing_wide,
        objective="val_accuracy",
        max_trials=5,
        seed=1,
        max_consecutive_failed_trials=5,
        directory=str(tmp_path),
        project_name="f",
    )
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=2, epochs=1, validation_data=slow_data(100, seed=5)
    )
    study = backend.client().t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED" and len(study["trials"]) == 5, study
    failed = [t for t in study["trials"] if t["status"] == "FAILED"]
    done = [t for t in study["trials"] if t["status"] == "COMPLETED"]
    assert failed and done, study["trials"]
    assert all(t["values"]["units"] > 24 for t in failed) and all(t["values"]["units"] <= 24 for t in done)
    assert all("cannot hold so many units" in t["message"] for t in failed), failed
    assert best is not None and study["best_trial_id"] in {t["trial_id"] for t in done}
    said = capsys.readouterr().err  # even a quiet search says which trials failed, and why
    assert f"{len(failed)} of 5 trials failed" in said, said
    for t in failed:
        assert f"trial {t['trial_id']}: ValueError: this machine cannot hold so many units" in said, said


def test_cancelling_a_study_cancels_its_running_trials_and_starts_no_more(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aibro_jupyter.search import start_study

    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    client = backend.client()
    x, y = slow_data(6000, seed=4)
    tuner = kt.RandomSearch(build_model, objective="val_accuracy", max_trials=10, directory=str(tmp_path))
    training = Training(client)
    request = FitRequest(
        None, x, y, machine_ids="local-cpu", epochs=200, batch_size=16, validation_data=slow_data(100, seed=5)
    )
    study_id = start_study(training, tuner, request, parallel=2, verbose=False)

    def running() -> list[dict[str, Any]]:
        trials = client.t.json("GET", f"/studies/{study_id}")["trials"]
        return [t for t in trials if client.job(t["job_id"]).status == v.TRAINING]

    assert wait_until(lambda: len(running()) == 2), "two trials training"
    cancelled = client.t.json("POST", f"/studies/{study_id}/cancel")
    assert cancelled["status"] == "CANCELED" and all(t["status"] == "CANCELED" for t in cancelled["trials"])
    for trial in cancelled["trials"]:
        assert training.watch(trial["job_id"], []).status == v.CANCELED
    later = client.t.json("GET", f"/studies/{study_id}")
    assert later["status"] == "CANCELED" and len(later["trials"]) == 2, "no trial started after the cancel"


def test_a_running_trials_loss_shows_batch_by_batch_before_its_first_epoch_ends(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38 item 5: what the study panel follows hands over the batches of a trial's first epoch as they come,
    and the panel draws them (dashed, part of the way to epoch 1) before the epoch ends."""
    from aibro_jupyter.search import start_study
    from aibro_jupyter.widgets.study_panel import StudyPanel

    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    client = backend.client()
    x, y = slow_data(24000, seed=4)  # an epoch of 1500 batches: several seconds here
    tuner = kt.RandomSearch(build_model, objective="loss", max_trials=1, directory=str(tmp_path))
    training = Training(client)
    request = FitRequest(None, x, y, machine_ids="local-cpu", epochs=50, batch_size=16)
    followed = TrialHistories(client)
    followed.since_last(Study.model_construct(trials=[]))  # the cursor from before the study, as the panel's
    study_id = start_study(training, tuner, request, verbose=False)
    panel = StudyPanel(study_id)

    def batches_only() -> tuple[Study, dict[str, list[dict[str, Any]]]] | None:
        study = client.study(study_id)
        histories = followed.since_last(study)
        panel.update(study, histories)
        rows = next(iter(histories.values()), [])
        return (study, histories) if rows and all("batch" in r for r in rows) else None

    try:
        seen = wait_until(batches_only)
        assert seen, "the trial's batches were handed over before its first epoch ended"
        study, histories = seen
        (rows,) = histories.values()
        assert all(r["epoch"] == 1 and r["steps"] == 1500 and r["loss"] > 0 for r in rows), rows
        assert [r["batch"] for r in rows] == sorted(r["batch"] for r in rows), "in the order they trained"
        (mark,) = panel.loss_chart.marks
        assert mark.line_style == "dashed" and all(0 < px < 1 for px in mark.x), list(mark.x)
        assert "the epoch in progress" in panel.loss_legend.value

        def an_epoch_done() -> list[dict[str, Any]] | None:
            rows = next(iter(followed.since_last(client.study(study_id)).values()), [])
            return rows if rows and "batch" not in rows[0] else None

        rows = wait_until(an_epoch_done)
        assert rows, "the first epoch ends"
        epochs = [r for r in rows if "batch" not in r]
        history = [r.model_dump() for r in client.job(study.trials[0].job_id).history]
        assert epochs == history[: len(epochs)], "the epochs' rows are the job's own history"
        assert all(r["epoch"] > len(epochs) for r in rows if "batch" in r), "an ended epoch's batches are gone"
    finally:
        client.cancel_study(study_id)


def test_a_study_its_trials_could_not_run_is_refused_before_it_starts(backend: Any) -> None:
    """What every trial's job would be refused for (here a cool-down over the backend's cap) refuses the study at
    POST /studies, naming the fix, before any trial starts."""
    client = backend.client()
    training = Training(client)
    x, y = slow_data(200, seed=6)
    spec = spec_json(_trial_spec(training, x, y)) | {"cool_down_s": 7200.0}
    hp = kt.HyperParameters()
    oracle = {"kind": "RandomSearch", "objective": [{"name": "loss", "direction": "min"}], "max_trials": 2}
    before = len(client.t.json("GET", "/studies")["studies"])
    with pytest.raises(ApiError) as refused:
        client.t.json("POST", "/studies", json={"oracle": oracle | {"hyperparameters": hp.get_config()}, "job": spec})
    assert refused.value.status == 400 and "cool_down_s=7200 is over this backend's cap" in str(refused.value)
    assert len(client.t.json("GET", "/studies")["studies"]) == before


def test_executions_per_trial_score_each_trial_as_keras_tuner_averages_its_fits(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """executions_per_trial=2 (issue 35): each trial is two fits of freshly built models, each its own job of two
    epochs, and its score is what KerasTuner computes from those two Histories (each one's best val_loss, then
    their mean); kt.Objective, validation_split and a callback in the search act as in a local search; the best
    model comes back at its best epoch with its optimizer state, and no Keras warning."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(400, seed=4)
    tuner = kt.RandomSearch(
        build_model,
        objective=kt.Objective("val_loss", direction="min"),
        max_trials=2,
        executions_per_trial=2,
        seed=5,
        directory=str(tmp_path),
        project_name="executions",
    )
    fit_kwargs = {"validation_split": 0.25, "callbacks": [keras.callbacks.LearningRateScheduler(halve)]}
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=2, epochs=2, batch_size=32, fit_kwargs=fit_kwargs
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED" and study["executions_per_trial"] == 2, study
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"] * 2, study["trials"]
    for trial in study["trials"]:
        runs = trial["executions"]
        assert [r["status"] for r in runs] == ["COMPLETED"] * 2 and len({r["job_id"] for r in runs}) == 2, runs
        histories = []
        for run in runs:
            job = client.job(run["job_id"])
            assert job.study_id == study_id and job.trial_id == trial["trial_id"], "the sidebar groups both"
            rows = [r.model_dump() for r in job.history]  # {"epoch": n, each log: its value}
            assert [r["epoch"] for r in rows] == [1, 2], rows  # one fit of two epochs per job
            assert rows[1]["learning_rate"] == pytest.approx(rows[0]["learning_rate"] * 0.5), rows  # the callback
            steps = {e["data"]["steps"] for e in client.events(run["job_id"])["events"] if e["type"] == "batch"}
            assert steps == {10}, steps  # validation_split=0.25 keeps 300 of 400 samples, in batches of 32
            history = keras.callbacks.History()
            history.history = {k: [r[k] for r in rows] for k in rows[0] if k != "epoch"}
            histories.append(history)
        expected = tuner_utils.convert_to_metrics_dict(histories, tuner.oracle.objective)
        assert trial["score"] == pytest.approx(float(expected["val_loss"]), rel=1e-6), (trial, expected)
        assert trial["metrics"] == pytest.approx({k: float(val) for k, val in expected.items()}, rel=1e-6)
        assert trial["best_step"] == tuner_utils.get_best_step(histories, tuner.oracle.objective)
        assert tuner.oracle.trials[trial["trial_id"]].score == pytest.approx(trial["score"])

    # The best trial's checkpoint is its best epoch of both executions; the kernel's tuner loads it whole.
    top = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
    checkpoint = top["checkpoint"]
    at_best = client.job(checkpoint["job_id"]).history[checkpoint["epoch"]].model_dump()
    assert at_best["val_loss"] == min(r["metrics"]["val_loss"] for r in top["executions"])
    reloaded = _assert_best_models_load_whole(tuner)
    assert int(reloaded.optimizer.iterations) == 10 * (checkpoint["epoch"] + 1)
    assert reloaded.evaluate(x[300:], y[300:], verbose=0)[0] == pytest.approx(at_best["val_loss"], rel=1e-4)
    assert best is not None and math.isfinite(best.evaluate(x[300:], y[300:], verbose=0)[0])


def test_a_hypermodel_trains_each_trial_with_what_its_own_fit_tunes(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keras_tuner.HyperModel subclass (issue 35) travels with its constructor's arguments; its fit(hp, model, ...)
    trains each trial, so the batch size it picks from hp is the one the trial's job ran; the hyperparameters it
    registers in fit join the study's space, as they join a local search's."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(512, seed=4)
    xv, yv = slow_data(128, seed=5)
    tuner = kt.RandomSearch(
        TunedFit(widen=2), objective="val_accuracy", max_trials=3, seed=3, directory=str(tmp_path), project_name="hm"
    )
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=1, epochs=1, validation_data=(xv, yv)
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert study["status"] == "COMPLETED" and len(study["trials"]) == 3, study
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"] * 3, study["trials"]
    first = study["trials"][0]["values"]
    assert (first["batch_size"], first["shuffle"], first["center"]) == (16, False, False), "fit's defaults, then"
    for trial in study["trials"]:
        steps = {e["data"]["steps"] for e in client.events(trial["job_id"])["events"] if e["type"] == "batch"}
        assert steps == {math.ceil(512 / trial["values"]["batch_size"])}, (trial["values"], steps)

    # The same HyperModel searched locally registers the same space; the kernel's tuner holds it too.
    local = kt.RandomSearch(
        TunedFit(widen=2), objective="val_accuracy", max_trials=1, directory=str(tmp_path), project_name="local"
    )
    local.search(x[:64], y[:64], epochs=1, validation_data=(xv[:32], yv[:32]), verbose=0)
    names = sorted(hp.name for hp in local.oracle.hyperparameters.space)
    assert names == ["batch_size", "center", "shuffle", "units"]
    assert sorted(hp.name for hp in tuner.oracle.hyperparameters.space) == names
    top = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
    assert tuner.get_best_hyperparameters()[0].values == top["values"]
    assert best.layers[0].units == 2 * top["values"]["units"], "widen=2 reached the worker"
    _assert_best_models_load_whole(tuner)


@pytest.mark.parametrize("as_value", [False, True], ids=["metrics", "value"])
def test_a_hypermodel_whose_fit_returns_its_score_is_scored_by_it(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_value: bool
) -> None:
    """A HyperModel.fit that evaluates the model itself (issue 35) and returns a dict of metrics, scored by the one
    kt.Objective names, or one value to minimize, with no objective given: each trial is scored by what it
    returned, as KerasTuner scores it."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(256, seed=4)
    objective = None if as_value else kt.Objective("metric_a", "max")
    tuner = kt.RandomSearch(
        ScoredFit(as_value=as_value),
        objective=objective,
        max_trials=2,
        seed=1,
        directory=str(tmp_path),
        project_name="scored",
    )
    study_id, best = Training.online_search(
        tuner, x, y, machine_ids="local-cpu", parallel=2, epochs=1, validation_data=slow_data(64, seed=5)
    )
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"] * 2, study["trials"]
    for trial in study["trials"]:
        logs = [e["data"] for e in client.events(trial["job_id"])["events"] if e["type"] == "log"]
        report = next(d["trial"] for d in logs if d.get("trial"))
        returned = {"default_objective": report["value"]} if as_value else report["metrics"]
        assert trial["metrics"] == pytest.approx(returned), (trial, report)
        assert trial["score"] == pytest.approx(returned["default_objective" if as_value else "metric_a"])
        assert trial["best_step"] == 0 and trial["checkpoint"]["epoch"] is None
    assert tuner.oracle.get_best_trials()[0].trial_id == study["best_trial_id"]
    _assert_best_models_load_whole(tuner)


def test_a_hypermodel_whose_fit_reshapes_x_is_not_checked_against_the_built_model(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data is what the HyperModel's own fit is given, not what its model takes: a fit that crops x trains, as
    locally, where checking x against the model at the space's defaults would refuse it."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(256, seed=4)
    wide = np.concatenate([x, x[:, :16]], axis=1)  # 80 features; the model takes 64
    tuner = kt.RandomSearch(
        CroppedFit(), objective="loss", max_trials=1, seed=1, directory=str(tmp_path), project_name="crop"
    )
    study_id, best = Training.online_search(tuner, wide, y, machine_ids="local-cpu")
    client = backend.client()
    study = client.t.json("GET", f"/studies/{study_id}")
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"], study["trials"]
    assert best.input_shape == (None, 64)
    epochs = [e["data"]["epoch"] for e in client.events(study["trials"][0]["job_id"])["events"] if e["type"] == "epoch"]
    assert epochs == [0, 1], "the epochs its own fit chose (the search was given none)"


def test_a_hypermodel_that_trains_an_uncompiled_model_with_a_loop_of_its_own(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KerasTuner takes a model its build() leaves uncompiled when its own fit() trains it (a custom loop returning
    the value to minimize): so does the remote search."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    x, y = slow_data(256, seed=4)
    tuner = kt.RandomSearch(LoopFit(), max_trials=1, seed=1, directory=str(tmp_path), project_name="loop")
    study_id, _ = Training.online_search(tuner, x, y, machine_ids="local-cpu", validation_data=slow_data(64, seed=5))
    study = backend.client().t.json("GET", f"/studies/{study_id}")
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"], study["trials"]
    trial = study["trials"][0]
    assert trial["score"] is not None and np.isfinite(trial["score"])
    epochs = [e["data"]["epoch"] for e in backend.client().events(trial["job_id"])["events"] if e["type"] == "epoch"]
    assert epochs == [0, 1], "each epoch its loop handed the callbacks was reported"
    assert sorted(hp.name for hp in tuner.oracle.hyperparameters.space) == ["learning_rate", "units"]


def test_a_search_scored_by_an_unregistered_metric_of_the_notebook(
    backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KerasTuner's guide's custom objective: a Metric class never registered (whose own config Keras cannot load
    back), named by kt.Objective; every trial scores by it and the best models load in the kernel."""
    monkeypatch.setenv("AIBRO_BACKEND_URL", backend.url)
    monkeypatch.setenv("AIBRO_TOKEN", backend.token)
    rng = np.random.default_rng(2)
    x, y = rng.random((100, 10)), rng.random((100, 1))
    tuner = kt.RandomSearch(
        build_regressor,
        objective=kt.Objective("val_custom_metric", direction="min"),
        max_trials=1,
        directory=str(tmp_path),
        project_name="custom_metric",
    )
    xv, yv = rng.random((20, 10)), rng.random((20, 1))
    study_id, best = Training.online_search(tuner, x, y, machine_ids="local-cpu", validation_data=(xv, yv))
    study = backend.client().t.json("GET", f"/studies/{study_id}")
    assert [t["status"] for t in study["trials"]] == ["COMPLETED"], study["trials"]
    assert "val_custom_metric" in study["trials"][0]["metrics"]
    assert "custom_metric" in best.evaluate(xv, yv, return_dict=True, verbose=0)
    _assert_best_models_load_whole(tuner)


def _assert_best_models_load_whole(tuner: Any) -> Any:
    """get_best_models() as a user calls it: no "Skipping variable loading for optimizer", and the optimizer's
    state (its step count) is back."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tuner.get_best_models()[0]
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    assert not skipped, skipped
    assert int(model.optimizer.iterations) > 0
    return model


def _trial_spec(training: Training, x: Any, y: Any, **trial: Any) -> JobSpec:
    """A trial job's spec made by hand (the build function at its space's defaults, and `trial`), its data
    uploaded."""
    hp = kt.HyperParameters()
    bundle, spec = training.prepare(FitRequest(build_model(hp), x, y, machine_ids="local-cpu", build=build_model))
    try:
        bundle.upload(training.client)
    finally:
        shutil.rmtree(bundle.workdir, ignore_errors=True)
    spec = uploaded(spec, bundle)
    assert spec.trial is not None
    trial.update(hyperparameters=hp.get_config(), values=dict(hp.values))
    return spec.model_copy(update={"trial": spec.trial.model_copy(update=trial)})
