"""A KerasTuner search run by the backend (issue 27): what the kernel's tuner says (its oracle, its space, its build
function or HyperModel, its executions_per_trial) becomes a study; each trial the backend's copy of that oracle hands
out runs as a job on the machines the user picked (one per execution), at most `parallel` at once; the study goes
on without the kernel, and the best trial's model comes back into it.

Issue 35 holds it to KerasTuner's whole contract: each point behaves as the same search run locally would, the
same trials scored the same way, the same hyperparameters reaching fit, and the tuner afterwards answering
get_best_hyperparameters / get_best_models / results_summary as after a local search."""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.compat import keras_tuner as kt_compat
from aibro_core.jobpicture import JobPicture
from aibro_core.kerasfile import keras_notes_quiet
from aibro_core.models import Study, StudyTrial, TrialCheckpoint

from .client import FOLLOW_BACKOFF, spec_json
from .errors import BackendUnreachable, StudyFailed, ValidationError
from .fitrequest import FitRequest
from .randomstate import random_state_kept
from .rebuildplan import kept_arguments
from .training import uploaded

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
LONG_POLL_S = 25.0  # how long one request waits for the study's next event (a job's follower waits as long)
PANEL_EVERY_S = 0.5  # a panel is drawn at most this often for its trials' epochs and batches (a study event: at once)
EVENT_PAGES_PER_POLL = 20
MAX_BATCH_ROWS = 200  # batch rows kept of a trial's epoch in progress


def travelling_hypermodel(tuner: Any) -> tuple[Any, dict[str, Any] | None, bool]:
    """What travels as code to build each trial on the worker, as (object, constructor arguments, own fit): the
    build function KerasTuner wrapped (no arguments), or the tuner's keras_tuner.HyperModel subclass with the
    arguments its object keeps (made again there, as callbacks are); own fit says its class overrides
    fit(hp, model, *args, **kwargs), which then trains each trial as KerasTuner lets it."""
    import keras_tuner as kt

    hypermodel = getattr(tuner, "hypermodel", None)
    build = getattr(hypermodel, "build", None)
    if type(hypermodel).__name__ == "DefaultHyperModel" and callable(build):
        return build, None, False
    if isinstance(hypermodel, kt.HyperModel):
        cls = type(hypermodel)
        return cls, hypermodel_arguments(hypermodel), cls.fit is not kt.HyperModel.fit
    raise ValidationError(
        f"the tuner's hypermodel is a {type(hypermodel).__name__}: a remote search takes a build function, as in "
        "keras_tuner.RandomSearch(build_model, ...) with def build_model(hp): ... return a compiled model, or a "
        "keras_tuner.HyperModel subclass"
    )


def hypermodel_arguments(hypermodel: Any) -> dict[str, Any]:
    """The constructor arguments a HyperModel keeps (an attribute of each one's name, as KerasTuner's own keep
    `name` and `tunable`), as JSON: the worker makes the object again with them."""
    import keras_tuner as kt

    cls = type(hypermodel)
    what = f"the HyperModel {cls.__name__}"
    kept = list(kept_arguments(hypermodel, cls.__init__, what, "__init__"))
    takes_more = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    if takes_more and cls.__init__ is not kt.HyperModel.__init__:  # name=, tunable= on to HyperModel's own
        named = {param.name for param, _ in kept}
        base = kept_arguments(hypermodel, kt.HyperModel.__init__, what, "__init__")
        kept += [(param, value) for param, value in base if param.name not in named]
    out: dict[str, Any] = {}
    for param, value in kept:
        if value is param.default:
            continue
        try:
            out[param.name] = _plain_json(value)
        except TypeError as exc:
            raise ValidationError(
                f"the HyperModel {cls.__name__}'s argument {param.name!r} is {exc}: the worker makes it again from "
                "its arguments, which must be numbers, strings, booleans, None, or lists and dicts of them"
            ) from None
    return out


def _plain_json(value: Any, depth: int = 0) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 8 and isinstance(value, (list, tuple)):
        return [_plain_json(item, depth + 1) for item in value]
    if depth < 8 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain_json(item, depth + 1) for k, item in value.items()}
    raise TypeError(f"a {type(value).__module__}.{type(value).__name__}")


def oracle_spec(tuner: Any, own_fit: bool = False) -> dict[str, Any]:
    """The tuner's oracle as the backend runs it: its kind, objective, arguments and search space. A tuner with no
    objective is taken only when its HyperModel's own fit may return the value to minimize, as KerasTuner's."""
    oracle = tuner.oracle
    kind = ORACLE_KINDS.get(type(oracle).__name__)
    if kind is None:
        raise ValidationError(
            f"{type(oracle).__name__} is not an oracle the backend runs: use RandomSearch, BayesianOptimization, "
            "Hyperband or GridSearch"
        )
    objectives = getattr(oracle.objective, "objectives", None) or [oracle.objective]
    if not own_fit and any(type(o).__name__ == "DefaultObjective" for o in objectives):
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


def follow_to_end(training: Any, tuner: Any, study_id: str, verbose: bool = True) -> Any:
    """Follow a study to its end (printing each trial as it starts and ends), fill `tuner` with its results and
    return the best trial's trained model (None when no trial completed); a study that ended FAILED raises, after
    its results are in the tuner, as KerasTuner's search does."""
    study = follow(training.client, study_id, verbose)
    assert study is not None  # follow returns None only when stopped
    model = finish(training, tuner, study)
    check_ended(study)
    return model


def given_args(request: FitRequest) -> set[str]:
    """The arguments a search call that made `request` was given, as a HyperModel's own fit is to get them: the
    ones set, and `epochs` (a FitRequest always has one; a caller that knows it was not given drops it)."""
    given = {k for k in ("batch_size", "validation_data") if getattr(request, k) is not None}
    return given | {"epochs"} | set(request.fit_kwargs or {})


def start_study(
    training: Any,
    tuner: Any,
    request: FitRequest,
    *,
    parallel: int = 1,
    verbose: bool = True,
    search_args: set[str] | None = None,
) -> str:
    """Check everything, upload the data and the build function's (or HyperModel's) code once, and start the
    study; its id. `request.model` is not read: each trial's model is the tuner's. `search_args` names the
    arguments the search call was given (default: `given_args`): a HyperModel's own fit gets exactly those, as
    from KerasTuner."""
    travelling, arguments, own_fit = travelling_hypermodel(tuner)
    oracle = oracle_spec(tuner, own_fit)
    sample = tuner.hypermodel.build(tuner.oracle.hyperparameters.copy())  # the space's defaults, checked on the data
    if search_args is None:
        search_args = given_args(request)
    bundle, spec = training.prepare(replace(request, model=sample, build=travelling, hypermodel_fit=own_fit))
    trial: dict[str, Any] = {"hyperparameters": oracle["hyperparameters"]}  # the backend checks them with the study
    if arguments is not None:
        trial["arguments"] = arguments
    if own_fit:
        trial["fit_args"] = sorted(set(search_args) - {"x", "y", "verbose"})
    try:
        bundle.upload(training.client)
        spec = uploaded(spec, bundle)
    finally:
        shutil.rmtree(bundle.workdir, ignore_errors=True)
    assert spec.trial is not None  # prepare made a trial's spec: it was given the build function
    spec = spec.model_copy(update={"trial": spec.trial.model_copy(update=trial)})
    executions = int(getattr(tuner, "executions_per_trial", 1) or 1)
    body = {"oracle": oracle, "job": spec_json(spec), "parallel": parallel, "description": request.description}
    if executions > 1:
        body["executions_per_trial"] = executions
    study = training.client.start_study(body)
    if verbose:
        each = f", {executions} executions each" if executions > 1 else ""
        print(f"[{study.study_id}] {oracle['kind']}: up to {parallel} trials at once{each}", flush=True)
    return study.study_id


def finish(training: Any, tuner: Any, study: Study) -> Any:
    """After the study: its trials into the kernel's tuner (load_results) and the best trial's trained model
    (weights and optimizer state; with several executions, the one holding the trial's checkpoint), or None when no
    trial completed."""
    if tuner is not None:
        load_results(training, tuner, study)
    best = study.best_trial_id
    if best is None:
        return None
    trial = next(t for t in study.trials if t.trial_id == best)
    job_id = (trial.checkpoint.job_id if trial.checkpoint else None) or trial.job_id
    model, _history = training.collect(training.watch(job_id, []))
    return model


def failures(study: Study) -> str | None:
    """What the user must hear of the trials that failed (each named with its error), or None when none did."""
    failed = [t for t in study.trials if t.status == v.TRIAL_FAILED]
    if not failed:
        return None
    named = "; ".join(f"trial {t.trial_id}: {_first_line(t.message)}" for t in failed)
    return f"{len(failed)} of {len(study.trials)} trials failed ({named})"


def check_ended(study: Study) -> None:
    """Raise StudyFailed for a study that ended FAILED, as KerasTuner's search raises once too many trials failed
    in a row (call it after the results are in the tuner: they are kept, as a local search keeps them)."""
    if study.status == v.STUDY_FAILED:
        why = study.message or "it failed"
        told = failures(study)
        raise StudyFailed(f"study {study.study_id} failed: {_first_line(why)}" + (f"; {told}" if told else ""))


def _first_line(text: str | None) -> str:
    """The line of an error that says what it was (a traceback's last)."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    return (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:300]


def load_results(training: Any, tuner: Any, study: Study) -> None:
    """The study's trials into the kernel's tuner, as a local search leaves them: its oracle holds every trial
    with its hyperparameters (a hyperparameter a HyperModel.fit registered joins the space, as KerasTuner's
    end_trial adds it), metrics and score, and each completed trial's checkpoint is where KerasTuner reloads it, so
    get_best_hyperparameters(), get_best_models() and results_summary() answer as after `tuner.search`."""
    import keras_tuner as kt
    from keras_tuner.engine import trial as trial_module

    oracle = tuner.oracle
    for t in study.trials:
        if t.hyperparameters:
            hp = kt.HyperParameters.from_config(t.hyperparameters)
            oracle.update_space(hp)
        else:
            hp = oracle.hyperparameters.copy()
            hp.values = dict(t.values)
        trial = trial_module.Trial(hyperparameters=hp, trial_id=t.trial_id, status=str(t.status))
        for name, value in t.metrics.items():
            trial.metrics.register(name, direction=kt_compat.infer_direction(oracle.objective, name))
            trial.metrics.update(name, value, step=t.best_step or 0)
        trial.score, trial.best_step, trial.message = t.score, t.best_step or 0, t.message
        oracle.trials[trial.trial_id] = trial
        for order in (oracle.start_order, oracle.end_order):
            if trial.trial_id not in order:
                order.append(trial.trial_id)
        if t.status == v.TRIAL_COMPLETED:
            _weights_into(training, tuner, t, hp)
        kt_compat.save_trial(oracle, trial)
    oracle.save()
    if "load_model" not in vars(tuner) and type(tuner).load_model is kt.Tuner.load_model:
        tuner.load_model = functools.partial(load_trial_model, tuner)


def load_trial_model(tuner: Any, trial: Any) -> Any:
    """KerasTuner's Tuner.load_model (build the trial's model, build it from its build config when it has no
    Input, load its checkpoint), with the optimizer built first: Keras then loads the optimizer's state with the
    weights instead of skipping it with "Skipping variable loading for optimizer", so get_best_models() gives
    the models as they were at their best epoch, ready to train on. A Hyperband trial that continued an earlier one
    is built without that link: its own checkpoint is loaded next."""
    from keras_tuner.engine.tuner import maybe_distribute

    hp = trial.hyperparameters.copy()
    hp.values.pop("tuner/trial_id", None)  # else Hyperband's build loads the earlier round's checkpoint first
    model = kt_compat.build_model(tuner, hp)
    with maybe_distribute(tuner.distribution_strategy):
        if not model.built:
            model.build_from_config(json.loads(Path(kt_compat.build_config_path(tuner, trial.trial_id)).read_text()))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        model.load_weights(kt_compat.checkpoint_path(tuner, trial.trial_id))
    return model


def _weights_into(training: Any, tuner: Any, trial: StudyTrial, hp: Any) -> None:
    """The trial's checkpoint where KerasTuner's load_model reads it (trial_<id>/checkpoint.weights.h5, optimizer
    state included, and its build config): the weights of its best epoch of all its executions, as KerasTuner's
    SaveBestEpoch keeps them (the job's final model for a trial whose HyperModel.fit returned its score). Loaded
    with the classes and functions its model names, as the kernel's build of that trial (with `hp`) finds them."""
    import keras

    from .kerasnames import plan_names

    dest = Path(kt_compat.checkpoint_path(tuner, trial.trial_id))
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = trial.checkpoint or TrialCheckpoint(job_id=trial.job_id, epoch=None)
    name = "model.keras" if checkpoint.epoch is None else v.checkpoint_name(checkpoint.epoch)
    with tempfile.TemporaryDirectory(prefix="aibro-trial-") as d:
        path = training.client.download_artifact(checkpoint.job_id, name, Path(d) / "model.keras")
        part = Path(d) / "checkpoint.weights.h5"
        with random_state_kept():
            objects = plan_names(tuner.hypermodel.build(hp)).local
        with keras_notes_quiet():
            model = keras.saving.load_model(path, custom_objects=objects)
        model.save_weights(part)
        Path(kt_compat.build_config_path(tuner, trial.trial_id)).write_text(json.dumps(model.get_build_config()))
        shutil.move(part, dest)


def follow(
    client: Any,
    study_id: str,
    verbose: bool = True,
    on_poll: Callable[[Study, dict[str, list[dict[str, Any]]]], None] | None = None,
    stop: threading.Event | None = None,
) -> Study | None:
    """Follow the study until it ends, saying what each trial does as it changes; with `on_poll` (a panel), hand it
    the study and the epoch history of each trial that trained since the last call. None when `stop` is set.

    It follows events, as a job's follower does (issue 40): it long-polls the study's own log (a trial started, a
    trial ended with its score, the study ended), or, for a panel, the user's event stream, which carries those
    events with the trials' epochs; the study is read again when its log moved. A backend that does not answer is
    waited for with the job follower's backoff (the study goes on in the backend)."""
    seen: dict[str, tuple[str, str]] = {}
    trained = TrialHistories(client) if on_poll is not None else None  # no request until the study is read
    study: Study | None = None
    histories: dict[str, list[dict[str, Any]]] = {}  # what the panel has not been handed yet
    handed = 0.0  # when the panel was last handed the study (monotonic)
    after = 0  # the study log's seq this follower has read up to
    down = 0  # failed requests in this outage of the backend
    while True:
        if stop is not None and stop.is_set():
            return None
        try:
            if study is None:
                study = client.study(study_id)
                histories = trained.since_last(study) if trained is not None else {}
                if trained is not None:  # read again after the stream's cursor: no study event falls between
                    study = client.study(study_id)
                    histories.update(trained.since_last(study))
            elif trained is not None:  # the user's stream wakes it for an epoch of a trial and for the study's events
                owed = PANEL_EVERY_S - (time.monotonic() - handed)
                histories.update(trained.since_last(study, wait=max(0.0, owed) if histories else LONG_POLL_S))
                if trained.logs_moved.pop(study_id, None) is not None:
                    study = client.study(study_id)
                    histories.update(trained.since_last(study))  # a trial that just started, at once
                elif time.monotonic() - handed < PANEL_EVERY_S:
                    continue  # epochs and batches come faster than a panel needs drawing: gather them
            else:
                page = client.study_events(study_id, after, wait=LONG_POLL_S)
                histories = {}
                if page["events"]:
                    after = int(page["events"][-1]["seq"])
                elif page["status"] not in v.STUDY_FINAL:
                    continue  # nothing happened within the wait: wait again
                study = client.study(study_id)
        except BackendUnreachable as exc:  # the study goes on in the backend: wait for it, as the job follower does
            if down == 0:
                print(f"[{study_id}] backend unreachable, retrying… ({exc})", file=sys.stderr, flush=True)
            down += 1
            if stop is None:
                time.sleep(FOLLOW_BACKOFF.delay(down - 1))
            elif stop.wait(FOLLOW_BACKOFF.delay(down - 1)):
                return None
            continue
        if down:
            down = 0
            print(f"[{study_id}] backend is back at {client.url}; carrying on", file=sys.stderr, flush=True)
        if stop is not None and stop.is_set():
            return None
        for trial in study.trials:
            now = (trial.status, trial.job_id)  # a trial's next execution is a line of its own
            if verbose and seen.get(trial.trial_id) != now:
                seen[trial.trial_id] = now
                print(trial_line(study, trial), flush=True)
        if on_poll is not None:
            on_poll(study, histories)
            histories, handed = {}, time.monotonic()
        if study.status in v.STUDY_FINAL:
            if verbose:
                why = f": {study.message}" if study.message else ""
                print(
                    f"[{study_id}] {study.status}{why}; best trial {study.best_trial_id}", file=sys.stdout, flush=True
                )
            told = failures(study)
            if told:  # said even when quiet: a failed trial is never silent
                print(f"[{study_id}] {told}", file=sys.stderr, flush=True)
            return study


class TrialHistories:
    """Each trial job's epoch rows, kept current from the user's event stream: one request a poll for every
    running trial, carrying only what is new (a job's whole view also carries its timeline and code). After them
    come the batches of the epoch in progress, as rows with a `batch` (from 1) and the epoch's `steps`, so a
    trial's loss shows before its first epoch ends."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cursor: int | None = None
        self.rows: dict[str, dict[int, dict[str, Any]]] = {}  # job id -> epoch number -> row
        self.batches: dict[str, list[dict[str, Any]]] = {}  # job id -> the batch rows of its epoch in progress
        self.handed: set[str] = set()  # trial ids handed over at least once
        self.logs_moved: dict[str, int] = {}  # study id -> the seq of its newest `study` event met in the stream

    def since_last(self, study: Study, wait: float = 0) -> dict[str, list[dict[str, Any]]]:
        """Trial id -> its epoch rows, for the trials that trained since the last call (and each new trial); after
        the first call, waiting up to `wait` s for the user's next event. A study's own events it meets are noted
        in `logs_moved` (study id -> its last seq seen) for the follower to read the study again."""
        trials = {t.job_id: t.trial_id for t in study.trials if t.job_id}
        moved = self._first_listing(trials) if self.cursor is None else self._new_epochs(wait)
        moved |= {job for job, trial in trials.items() if trial not in self.handed}
        out = {trials[job]: self._rows(job) for job in moved if job in trials}
        self.handed |= set(out)
        return out

    def _first_listing(self, trials: dict[str, str]) -> set[str]:
        listing = self.client.job_listing()  # its cursor is taken before the views: nothing falls between
        self.cursor = listing.cursor
        for view in listing.jobs:
            if view.job_id in trials or view.status not in v.JOB_FINAL:  # a trial the study lists next
                self.rows[view.job_id] = {r.epoch: r.model_dump() for r in view.history}  # rows as events make them
        return set(trials)

    def _new_epochs(self, wait: float = 0) -> set[str]:
        epochs: dict[str, list[dict[str, Any]]] = {}
        batched: set[str] = set()
        for _ in range(EVENT_PAGES_PER_POLL):
            page = self.client.user_events(self.cursor, wait)
            wait = 0  # the first page waits for news; the rest is what came with it
            self.cursor = int(page["cursor"])
            for ev in page["events"]:
                if ev["type"] == v.EV_EPOCH:
                    epochs.setdefault(ev["job_id"], []).append(ev)
                elif ev["type"] == v.EV_STUDY:
                    self.logs_moved[ev["job_id"]] = int(ev["seq"])
                elif ev["type"] == v.EV_BATCH:
                    self._batch(ev["job_id"], ev["data"])
                    batched.add(ev["job_id"])
            if not page["events"]:
                break
        for job, evs in epochs.items():  # an epoch a resumed attempt ran again replaces the lost one's
            self.rows.setdefault(job, {}).update({r["epoch"]: r for r in JobPicture().apply_all(evs).history_rows()})
        return set(epochs) | batched

    def _batch(self, job: str, data: dict[str, Any]) -> None:
        """Keep a batch of the epoch in progress (a new epoch drops the last one's; a long epoch keeps every other)."""
        logs = data.get("logs") or {}
        row = {**logs, "epoch": int(data["epoch"]) + 1, "batch": int(data["batch"]) + 1, "steps": data.get("steps")}
        kept = [r for r in self.batches.get(job, []) if r["epoch"] == row["epoch"]]
        self.batches[job] = (kept[::2] if len(kept) >= MAX_BATCH_ROWS else kept) + [row]

    def _rows(self, job: str) -> list[dict[str, Any]]:
        rows = [r for _, r in sorted(self.rows.get(job, {}).items())]
        done = rows[-1]["epoch"] if rows else 0
        return rows + [r for r in self.batches.get(job, []) if r["epoch"] > done]


def trial_line(study: Study, trial: StudyTrial) -> str:
    values = ", ".join(f"{k}={v}" for k, v in trial.values.items() if not k.startswith("tuner/"))
    objective = study.objective[0]["name"] if len(study.objective) == 1 else "multi_objective"
    runs = trial.executions
    if trial.status == v.TRIAL_COMPLETED:
        mean = f" (mean of {len(runs)} executions)" if len(runs) > 1 else ""
        return f"  trial {trial.trial_id} COMPLETED {objective}={trial.score:.4g}{mean} ({values})"
    if trial.status == v.TRIAL_FAILED:
        return f"  trial {trial.trial_id} FAILED: {_first_line(trial.message)} ({values})"
    wanted = study.executions_per_trial or 1
    execution = f" (execution {len(runs)} of {wanted})" if wanted > 1 and runs else ""
    return f"  trial {trial.trial_id} {trial.status} as {trial.job_id}{execution} ({values})"
