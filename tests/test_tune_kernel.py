"""%%cloud_tune in a real kernel (issue 27 items 1, 3, 5 and 6): the cell's one `tuner.search(...)` runs as a study
on the embedded backend, two trials at a time, and the statements after it see the tuner as after a local search;
a kernel killed mid-study leaves the study running, and `%cloud_attach STUDY --tuner tuner` in a new kernel shows
every trial exactly once and fills that kernel's tuner. Issue 35 item 4: a notebook's own HyperModel, with its own
fit and several executions per trial, and a trial that fails, said in the cell."""

from __future__ import annotations

import math
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
            "print('BEST', best_hp.values, round(tuner.get_best_models()[0].evaluate(x_val, y_val, verbose=0)[1], 4))\n"
            "print('FINAL', round(best_model.evaluate(x_val, y_val, verbose=0)[1], 4))\n"
            "print('TRIALS', len(tuner.oracle.trials))",
            timeout=600,
        )
        assert not res.error, res.error + res.stdout
        study_id = re.search(r"\[(study-\S+)\] RandomSearch: up to 2 trials at once", res.stdout).group(1)
        study = client.t.json("GET", f"/studies/{study_id}")
        assert study["status"] == "COMPLETED" and len(study["trials"]) == 4
        best = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
        assert f"BEST {best['values']} {round(best['score'], 4)}" in res.stdout, "its best epoch: " + res.stdout
        final = client.job(best["job_id"]).history[-1].val_accuracy
        assert f"FINAL {round(final, 4)}" in res.stdout, "best_model: the job's final model, " + res.stdout
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


HYPERMODEL = """
class Tuned(kt.HyperModel):
    def __init__(self, widen=1, **kwargs):
        super().__init__(**kwargs)
        self.widen = widen

    def build(self, hp):
        units = hp.Int("units", 8, 32, step=8)
        hp.Choice("batch_size", [32, 128])  # used by fit: KerasTuner's guide declares it in build, reads it there
        if units > 24:
            raise ValueError(f"{units} units are too many here")
        m = keras.Sequential([keras.layers.Dense(units * self.widen, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])  # no Input: built on its first call
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    def fit(self, hp, model, x, y, **kwargs):
        return model.fit(x, y, batch_size=hp.get("batch_size"), **kwargs)
"""


def test_a_notebooks_hypermodel_runs_its_executions_and_names_the_trial_that_failed(  # noqa: ANN001
    aibro_home: Path, client, tmp_path
) -> None:
    """The HyperModel class of a notebook cell travels with its constructor's argument; its fit trains each trial
    (the job ran the batch size it read from hp), twice per trial; kt.Objective and validation_split reach the
    search; the trial whose build raises (seed 4 hands out units=32 second) is named in the cell with its error while
    the study goes on; get_best_models() gives a model with its optimizer state and no warning."""
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        assert not run_cell(kc, TUNE_SETUP + HYPERMODEL, timeout=180).error
        res = run_cell(
            kc,
            "%%cloud_tune -m local-cpu --parallel 2\n"
            "tuner = kt.RandomSearch(Tuned(widen=2), objective=kt.Objective('val_accuracy', direction='max'), "
            f"max_trials=4, executions_per_trial=2, seed=4, max_consecutive_failed_trials=4, "
            f"directory={str(tmp_path)!r}, project_name='hypermodel')\n"
            "tuner.search(x_train, y_train, epochs=1, validation_split=0.2)\n"
            "import warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    reloaded = tuner.get_best_models()[0]\n"
            "print('SKIPPED', [str(w.message) for w in caught if 'Skipping variable' in str(w.message)])\n"
            "print('ITERATIONS', int(reloaded.optimizer.iterations), 'WIDE', best_model.layers[0].units)",
            timeout=600,
        )
        assert not res.error, res.error + res.stdout
        study_id = re.search(r"\[(study-\S+)\] RandomSearch: up to 2 trials at once, 2 executions each", res.stdout)
        study = client.t.json("GET", f"/studies/{study_id.group(1)}")
        assert study["status"] == "COMPLETED" and len(study["trials"]) == 4, study
        failed = [t for t in study["trials"] if t["status"] == "FAILED"]
        done = [t for t in study["trials"] if t["status"] == "COMPLETED"]
        assert [t["values"]["units"] for t in failed] == [32] and len(done) == 3, study["trials"]
        said = f"trial {failed[0]['trial_id']}: execution 1 of 2: ValueError: 32 units are too many here"
        assert f"1 of 4 trials failed ({said})" in res.stdout, res.stdout
        for trial in done:
            assert len(trial["executions"]) == 2, trial
            for run in trial["executions"]:
                events = client.events(run["job_id"])["events"]
                steps = {e["data"]["steps"] for e in events if e["type"] == "batch"}
                assert steps == {math.ceil(1120 / trial["values"]["batch_size"])}, (trial["values"], steps)
        best = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
        assert "SKIPPED []" in res.stdout, res.stdout
        iterations = int(re.search(r"ITERATIONS (\d+) WIDE", res.stdout).group(1))
        assert iterations == math.ceil(1120 / best["values"]["batch_size"]), res.stdout
        assert f"WIDE {2 * best['values']['units']}" in res.stdout, res.stdout
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
