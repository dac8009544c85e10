"""KerasTuner internals (checked with keras-tuner 1.4.8; see tests/test_compat.py and tests/try_newest.py).

The backend drives KerasTuner's own oracle trial by trial (tuning/oracle_host.py) and the kernel puts a remote
study's trials into the user's tuner (aibro_jupyter/search.py) as a local `search` leaves them: both do from the
outside what KerasTuner's Tuner does from the inside, and a Tuner reaches these through private names."""

from __future__ import annotations

import json
import os
from typing import Any


def infer_direction(objective: Any, metric_name: str) -> str | None:
    """The direction ("min" or "max"; None where no objective names it) of `metric_name` under the oracle's
    `objective`, as the oracle's own `update_trial` registers a metric
    (`keras_tuner.src.engine.oracle._maybe_infer_direction_from_objective`); not exported."""
    from keras_tuner.src.engine.oracle import _maybe_infer_direction_from_objective

    return _maybe_infer_direction_from_objective(objective, metric_name)


def save_trial(oracle: Any, trial: Any) -> None:
    """Write `trial.json` into the trial's directory, as the oracle does when a trial changes (`Oracle._save_trial`):
    a trial put into the oracle from outside must be on disk the same way for `reload()` and the Tuner."""
    oracle._save_trial(trial)


def set_project_dir(oracle: Any, directory: str, project_name: str) -> None:
    """Give a free-standing oracle its project directory, as a Tuner does with its oracle (`Oracle._set_project_dir`):
    the oracle's constructor takes none, and a Tuner is the only public way to set it."""
    oracle._set_project_dir(directory, project_name)


def forget_pending_retry(oracle: Any, trial_id: str) -> None:
    """Take `trial_id` out of the oracle's queue of trials to hand out again (`Oracle._retry_queue`), where its
    `reload()` put every trial that was running: the backend still runs it as a job. No public call un-queues a
    trial."""
    if trial_id in oracle._retry_queue:
        oracle._retry_queue.remove(trial_id)


def atomic_json_saves() -> None:
    """From now on, KerasTuner writes its JSON files (the oracle's `oracle.json` and each `trial.json`, all through
    `keras_tuner.src.utils.save_json`, which `Stateful.save` calls) whole or not at all: to a file beside, synced,
    then renamed over the old one. KerasTuner truncates and rewrites them in place, so a process killed mid-write
    leaves an empty or half file that its `reload()` cannot read, and the study could never go on. No public hook;
    local paths only (the oracle host's own study folder)."""
    from keras_tuner.src import utils

    def save_json(path: str, obj: Any) -> str:
        text = json.dumps(obj)
        part = f"{path}.part-{os.getpid()}"
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
        return text

    utils.save_json = save_json


def build_model(tuner: Any, hyperparameters: Any) -> Any:
    """The tuner's model for `hyperparameters`, built as its `load_model` builds it (`Tuner._try_build`: a fresh
    session, the hypermodel's build, its checks); the public `hypermodel.build` skips the checks and the clean-up."""
    return tuner._try_build(hyperparameters)


def checkpoint_path(tuner: Any, trial_id: str) -> str:
    """Where the tuner keeps a trial's checkpoint and its `load_model` reads it (`Tuner._get_checkpoint_fname`:
    trial_<id>/checkpoint.weights.h5 under Keras 3); no public accessor."""
    return tuner._get_checkpoint_fname(trial_id)


def build_config_path(tuner: Any, trial_id: str) -> str:
    """Where the tuner keeps a trial's model build config, read by `load_model` for a model without an Input
    (`Tuner._get_build_config_fname`); no public accessor."""
    return tuner._get_build_config_fname(trial_id)
