"""A study's trial model (issue 27), built on the worker as KerasTuner builds one: the user's build function, from
the job's travelling code, called with KerasTuner's HyperParameters of the study's space set to the trial's values.
The model is saved where a submitted model would be, so the job goes on exactly as any other."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build_trial_model(trial: dict[str, Any], path: Path, earlier: Callable[[str], Path]) -> None:
    """Build, check and save the trial's model at `path`. A trial that resumes an earlier one (Hyperband's next
    round, whose epochs and initial_epoch the study put in the job's fit) starts from that trial's trained weights,
    fetched by `earlier(job_id)`, as KerasTuner's Hyperband loads its checkpoint."""
    try:
        import keras_tuner as kt
    except ImportError:
        raise RuntimeError(
            "keras-tuner is not installed on this machine: add requirements=['keras-tuner'] to the search (the "
            "kernel's version), or install it where the worker runs"
        ) from None
    module, _, name = trial["build"].partition(":")
    build = getattr(importlib.import_module(module), name, None)
    if not callable(build):
        raise RuntimeError(f"the job's code has no function {name!r} in {module}: the study's build function")
    hp = kt.HyperParameters.from_config(trial["hyperparameters"])
    hp.values = dict(trial["values"])
    model = build(hp)
    if trial.get("resume_job"):
        model.load_weights(earlier(trial["resume_job"]))
    if getattr(model, "optimizer", None) is None:
        raise RuntimeError(
            f"{name}(hp) returned a model that is not compiled: call model.compile(...) in it, as KerasTuner needs"
        )
    model.save(path)
