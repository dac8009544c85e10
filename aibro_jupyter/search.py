"""A KerasTuner search run by the backend (issue 27): what the kernel's tuner says (its oracle, its space, its build
function) becomes a study; each trial the backend's copy of that oracle hands out runs as a job on the machines
the user picked, at most `parallel` at once; the study goes on without the kernel, and the best trial's model comes
back into it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture

from .errors import ValidationError

ORACLE_KINDS = {
    "RandomSearchOracle": "RandomSearch",
    "BayesianOptimizationOracle": "BayesianOptimization",
    "HyperbandOracle": "Hyperband",
    "GridSearchOracle": "GridSearch",
}
ORACLE_ARGS = (
    "max_trials",
    "seed",
    "max_retries_per_trial",
    "max_consecutive_failed_trials",
    "max_epochs",
    "factor",
    "hyperband_iterations",
    "num_initial_points",
    "alpha",
    "beta",
)
STUDY_FINAL = ("COMPLETED", "CANCELED", "FAILED")
POLL_S = 1.0
EVENT_PAGES_PER_POLL = 20


def build_function(tuner: Any) -> Callable[[Any], Any]:
    """The user's `build_model(hp)` the tuner was given (KerasTuner wraps a function in a DefaultHyperModel)."""
    hypermodel = getattr(tuner, "hypermodel", None)
    build = getattr(hypermodel, "build", None)
    if type(hypermodel).__name__ != "DefaultHyperModel" or not callable(build):
        raise ValidationError(
            f"the tuner's hypermodel is a {type(hypermodel).__name__}: a remote search takes a build function, "
            "as in keras_tuner.RandomSearch(build_model, ...) with def build_model(hp): ... return a compiled model"
        )
    return build


def oracle_spec(tuner: Any) -> dict[str, Any]:
    """The tuner's oracle as the backend runs it: its kind, objective, arguments and search space."""
    oracle = tuner.oracle
    kind = ORACLE_KINDS.get(type(oracle).__name__)
    if kind is None:
        raise ValidationError(
            f"{type(oracle).__name__} is not an oracle the backend runs: use RandomSearch, BayesianOptimization, "
            "Hyperband or GridSearch"
        )
    objectives = getattr(oracle.objective, "objectives", None) or [oracle.objective]
    if any(type(o).__name__ == "DefaultObjective" for o in objectives):
        raise ValidationError(
            "the tuner has no objective: give it one the trials report, e.g. objective='val_loss' (or "
            "keras_tuner.Objective('val_auc', direction='max'))"
        )
    spec: dict[str, Any] = {
        "kind": kind,
        "objective": [{"name": o.name, "direction": o.direction} for o in objectives],
        "hyperparameters": oracle.hyperparameters.get_config(),
    }
    for name in ORACLE_ARGS:
        value = getattr(oracle, name, None)
        if value is not None and not (name in ("max_retries_per_trial",) and value == 0):
            spec[name] = value
    if kind == "Hyperband":
        spec.pop("max_trials", None)
    return spec


def run_search(
    training: Any, tuner: Any, x: Any, y: Any = None, *, verbose: bool = True, **options: Any
) -> tuple[str, Any]:
    """Start the study, follow it to its end (printing each trial as it starts and ends), fill `tuner` with its
    results and return (study id, the best trial's trained model, or None when no trial completed)."""
    study_id = start_study(training, tuner, x, y, verbose=verbose, **options)
    return study_id, finish(training, tuner, follow(training.client, study_id, verbose))


def start_study(
    training: Any,
    tuner: Any,
    x: Any,
    y: Any = None,
    *,
    parallel: int = 1,
    description: str = "",
    verbose: bool = True,
    **fit: Any,
) -> str:
    """Check everything, upload the data and the build function's code once, and start the study; its id."""
    build = build_function(tuner)
    oracle = oracle_spec(tuner)
    sample = build(tuner.oracle.hyperparameters.copy())  # the space's defaults: checked against the data
    bundle, spec = training.prepare(sample, x, y, description=description, build=build, **fit)
    try:
        spec["trial"]["hyperparameters"] = oracle["hyperparameters"]
        bundle.upload(training.client)
        spec.update(data=bundle.data)
    finally:
        shutil.rmtree(bundle.workdir, ignore_errors=True)
    study = training.client.t.json(
        "POST", "/studies", json={"oracle": oracle, "job": spec, "parallel": parallel, "description": description}
    )
    if verbose:
        print(f"[{study['study_id']}] {oracle['kind']}: up to {parallel} trials at once", flush=True)
    return str(study["study_id"])


def finish(training: Any, tuner: Any, study: dict[str, Any]) -> Any:
    """After the study: its trials into the kernel's tuner (load_results) and the best trial's trained model
    (weights and optimizer state), or None when no trial completed."""
    if tuner is not None:
        load_results(training, tuner, study)
    best = study.get("best_trial_id")
    if best is None:
        return None
    job_id = next(t["job_id"] for t in study["trials"] if t["trial_id"] == best)
    model, _history = training.collect(training.watch(job_id, []))
    return model


def load_results(training: Any, tuner: Any, study: dict[str, Any]) -> None:
    """The study's trials into the kernel's tuner, as a local search leaves them: its oracle holds every trial
    with its values, metrics and score, and each completed trial's weights are where KerasTuner reloads them, so
    get_best_hyperparameters(), get_best_models() and results_summary() answer as after `tuner.search`."""
    from keras_tuner.src.engine import trial as trial_module

    oracle = tuner.oracle
    for t in study["trials"]:
        hp = oracle.hyperparameters.copy()
        hp.values = dict(t["values"])
        trial = trial_module.Trial(hyperparameters=hp, trial_id=t["trial_id"], status=t["status"])
        for name, value in (t.get("metrics") or {}).items():
            trial.metrics.register(name, direction=_direction(study, name))
            trial.metrics.update(name, value, step=t.get("best_step") or 0)
        trial.score, trial.best_step, trial.message = t["score"], t.get("best_step") or 0, t.get("message")
        oracle.trials[trial.trial_id] = trial
        for order in (oracle.start_order, oracle.end_order):
            if trial.trial_id not in order:
                order.append(trial.trial_id)
        if t["status"] == "COMPLETED":
            _weights_into(training, tuner, t)
        oracle._save_trial(trial)
    oracle.save()


def _direction(study: dict[str, Any], name: str) -> str | None:
    for objective in study["objective"]:
        if objective["name"] == name:
            return objective["direction"]
    from keras_tuner.src.engine import metrics_tracking

    return metrics_tracking.infer_metric_direction(name)


def _weights_into(training: Any, tuner: Any, trial: dict[str, Any]) -> None:
    """The trial's trained weights where KerasTuner's load_model reads them (trial_<id>/checkpoint.weights.h5)."""
    import keras

    dest = Path(tuner._get_checkpoint_fname(trial["trial_id"]))
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aibro-trial-") as d:
        path = training.client.download_artifact(trial["job_id"], "model.keras", Path(d) / "model.keras")
        part = Path(d) / "checkpoint.weights.h5"
        model = keras.saving.load_model(path)
        model.save_weights(part)
        Path(tuner._get_build_config_fname(trial["trial_id"])).write_text(json.dumps(model.get_build_config()))
        shutil.move(part, dest)


def follow(
    client: Any,
    study_id: str,
    verbose: bool = True,
    on_poll: Callable[[dict[str, Any], dict[str, list[dict[str, Any]]]], None] | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any] | None:
    """Poll the study until it ends, saying what each trial does as it changes; with `on_poll` (a panel), hand it
    the study and the epoch history of each trial that trained since the last poll. None when `stop` is set."""
    seen: dict[str, str] = {}
    trained = TrialHistories(client)  # no request until the first poll that has a panel to hand it to
    while True:
        study = client.t.json("GET", f"/studies/{study_id}")
        for trial in study["trials"]:
            if verbose and seen.get(trial["trial_id"]) != trial["status"]:
                seen[trial["trial_id"]] = trial["status"]
                print(trial_line(study, trial), flush=True)
        if on_poll is not None:
            on_poll(study, trained.since_last(study))
        if study["status"] in STUDY_FINAL:
            if verbose:
                best = study.get("best_trial_id")
                why = f": {study['message']}" if study.get("message") else ""
                print(f"[{study_id}] {study['status']}{why}; best trial {best}", file=sys.stdout, flush=True)
            return study
        if stop is None:
            time.sleep(POLL_S)
        elif stop.wait(POLL_S):
            return None


class TrialHistories:
    """Each trial job's epoch rows, kept current from the user's event stream: one request a poll for every
    running trial, carrying only what is new (a job's whole view also carries its timeline and code)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cursor: int | None = None
        self.rows: dict[str, dict[int, dict[str, Any]]] = {}  # job id -> epoch number -> row
        self.handed: set[str] = set()  # trial ids handed over at least once

    def since_last(self, study: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Trial id -> its epoch rows, for the trials that trained since the last call (and each new trial)."""
        trials = {t["job_id"]: t["trial_id"] for t in study["trials"] if t.get("job_id")}
        moved = self._first_listing(trials) if self.cursor is None else self._new_epochs()
        moved |= {job for job, trial in trials.items() if trial not in self.handed}
        out = {trials[job]: [r for _, r in sorted(self.rows.get(job, {}).items())] for job in moved if job in trials}
        self.handed |= set(out)
        return out

    def _first_listing(self, trials: dict[str, str]) -> set[str]:
        listing = self.client.t.json("GET", "/jobs")  # its cursor is taken before the views: nothing falls between
        self.cursor = int(listing["cursor"])
        for view in listing["jobs"]:
            if view["job_id"] in trials or view["status"] not in v.JOB_FINAL:  # a trial the study lists next
                self.rows[view["job_id"]] = {r["epoch"]: r for r in view["history"]}
        return set(trials)

    def _new_epochs(self) -> set[str]:
        epochs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(EVENT_PAGES_PER_POLL):
            page = self.client.user_events(self.cursor)
            self.cursor = int(page["cursor"])
            for ev in page["events"]:
                if ev["type"] == v.EV_EPOCH:
                    epochs.setdefault(ev["job_id"], []).append(ev)
            if not page["events"]:
                break
        for job, evs in epochs.items():  # an epoch a resumed attempt ran again replaces the lost one's
            self.rows.setdefault(job, {}).update({r["epoch"]: r for r in JobPicture().apply_all(evs).history_rows()})
        return set(epochs)


def trial_line(study: dict[str, Any], trial: dict[str, Any]) -> str:
    values = ", ".join(f"{k}={v}" for k, v in trial["values"].items() if not k.startswith("tuner/"))
    objective = study["objective"][0]["name"]
    if trial["status"] == "COMPLETED":
        return f"  trial {trial['trial_id']} COMPLETED {objective}={trial['score']:.4g} ({values})"
    if trial["status"] == "FAILED":
        return f"  trial {trial['trial_id']} FAILED: {trial['message']} ({values})"
    return f"  trial {trial['trial_id']} {trial['status']} as {trial['job_id']} ({values})"
