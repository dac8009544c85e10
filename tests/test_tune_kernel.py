"""%%cloud_tune in a real kernel (issue 27 items 1, 3, 5 and 6): the cell's one `tuner.search(...)` runs as a study
on the embedded backend, two trials at a time, and the statements after it see the tuner as after a local search;
a kernel killed mid-study leaves the study running, and `%cloud_attach STUDY --tuner tuner` in a new kernel shows
every trial exactly once and fills that kernel's tuner."""

from __future__ import annotations

import re
from pathlib import Path

from kernel_helpers import TUNE_SETUP, run_cell, start_kernel


def _tuner(directory: Path, trials: int, project: str) -> str:
    return (
        f"tuner = kt.RandomSearch(build_model, objective='val_accuracy', max_trials={trials}, seed=3, "
        f"directory={str(directory)!r}, project_name={project!r})\n"
    )


def test_a_cloud_tune_cell_runs_its_search_remotely_and_the_rest_here(aibro_home: Path, client, tmp_path) -> None:  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        assert not run_cell(kc, TUNE_SETUP, timeout=180).error
        res = run_cell(
            kc,
            "%%cloud_tune -m local-cpu --parallel 2\n"
            + _tuner(tmp_path, 4, "cell")
            + "tuner.search(x_train, y_train, epochs=2, validation_data=(x_val, y_val))\n"
            "best_hp = tuner.get_best_hyperparameters()[0]\n"
            "print('BEST', best_hp.values, round(best_model.evaluate(x_val, y_val, verbose=0)[1], 4))\n"
            "print('TRIALS', len(tuner.oracle.trials))",
            timeout=600,
        )
        assert not res.error, res.error + res.stdout
        study_id = re.search(r"\[(study-\S+)\] RandomSearch: up to 2 trials at once", res.stdout).group(1)
        study = client.t.json("GET", f"/studies/{study_id}")
        assert study["status"] == "COMPLETED" and len(study["trials"]) == 4
        best = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
        assert f"BEST {best['values']} {round(best['score'], 4)}" in res.stdout, res.stdout
        assert "TRIALS 4" in res.stdout
        for t in study["trials"]:
            assert res.stdout.count(f"trial {t['trial_id']} COMPLETED") == 1, res.stdout
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_study_outlives_its_kernel_and_attaches_in_a_new_one(aibro_home: Path, client, tmp_path) -> None:  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    res = run_cell(kc, TUNE_SETUP, timeout=180)
    assert not res.error, res.error
    res = run_cell(
        kc,
        "%%cloud_tune -m local-cpu --parallel 2\n"
        + _tuner(tmp_path / "first", 6, "killed")
        + "tuner.search(x_train, y_train, epochs=2, validation_data=(x_val, y_val))",
        timeout=600,
        until=" COMPLETED ",
    )
    km.shutdown_kernel(now=True)  # mid-study: one trial ended, others running or to come
    kc.stop_channels()
    study_id = re.search(r"\[(study-\S+)\]", res.stdout).group(1)
    assert client.t.json("GET", f"/studies/{study_id}")["status"] == "RUNNING", "the study outlives its kernel"

    km2, kc2 = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        assert not run_cell(kc2, TUNE_SETUP, timeout=180).error
        res = run_cell(
            kc2,
            _tuner(tmp_path / "second", 6, "attached") + f"%cloud_attach {study_id} --tuner tuner\n"
            "print('TRIALS', sorted(tuner.oracle.trials), tuner.get_best_hyperparameters()[0].values)\n"
            "print('ACC', round(best_model.evaluate(x_val, y_val, verbose=0)[1], 4))",
            timeout=600,
        )
        assert not res.error, res.error + res.stdout
        study = client.t.json("GET", f"/studies/{study_id}")
        assert study["status"] == "COMPLETED" and [t["status"] for t in study["trials"]] == ["COMPLETED"] * 6
        for t in study["trials"]:
            assert res.stdout.count(f"trial {t['trial_id']} COMPLETED") == 1, res.stdout
        best = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
        ids = sorted(t["trial_id"] for t in study["trials"])
        assert f"TRIALS {ids} {best['values']}" in res.stdout, res.stdout
        assert f"ACC {round(best['score'], 4)}" in res.stdout, res.stdout
        jobs = [t["job_id"] for t in study["trials"]]
        assert len(set(jobs)) == 6, "each trial ran as one job, once"
    finally:
        kc2.stop_channels()
        km2.shutdown_kernel(now=True)
