"""A study's trial model (issue 27), built on the worker as KerasTuner builds one: the user's build function, or
their keras_tuner.HyperModel subclass made again from its constructor arguments (issue 35), from the job's
travelling code, called with KerasTuner's HyperParameters of the study's space set to the trial's values. The model
is saved where a submitted model would be, so the job goes on exactly as any other; a HyperModel that overrides
fit(hp, model, *args, **kwargs) trains it itself (`TrialRun.fit_call`), as KerasTuner lets it."""

from __future__ import annotations

import importlib
import json
import math
import numbers
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aibro_core.models import TrialBuild

NOT_PASSED_ON = ("x", "y", "verbose")  # x and y go positionally; the worker's fit prints no progress bar


class TrialRun:
    """One trial's build, kept for its fit: the HyperModel (None for a build function), the hyperparameters it
    built with (a HyperModel.fit may register more in them), and what its fit returned."""

    def __init__(
        self, name: str, build: Callable[[Any], Any], hypermodel: Any, hp: Any, fit_args: list[str] | None
    ) -> None:
        self.name, self.build, self.hypermodel, self.hp, self.fit_args = name, build, hypermodel, hp, fit_args
        self.result: Any = None

    def fit_call(self, model: Any) -> Callable[..., Any]:
        """What the worker calls instead of `model.fit(x, y, sample_weight=..., validation_data=..., callbacks=...,
        verbose=0, **fit)`: that, or the HyperModel's own fit given what KerasTuner gives it, namely the search's
        arguments and the callbacks (the user's, then the worker's)."""

        def fit(x: Any, y: Any = None, *, callbacks: list[Any], verbose: int = 0, **given: Any) -> Any:
            if self.fit_args is None:
                self.result = model.fit(x, y, callbacks=callbacks, verbose=verbose, **given)
                return self.result
            kwargs = {k: given[k] for k in self.fit_args if k in given and k not in NOT_PASSED_ON}
            if given.get("initial_epoch"):  # a resumed attempt (spot) goes on from its last checkpoint
                kwargs["initial_epoch"] = given["initial_epoch"]
            kwargs["callbacks"] = callbacks
            args = (x,) if y is None else (x, y)
            import keras

            with _quiet_fit(model):
                self.result = self.hypermodel.fit(self.hp, model, *args, **kwargs)
            if isinstance(self.result, keras.callbacks.History) and getattr(callbacks[-1], "model", None) is None:
                raise RuntimeError(  # its History's epochs were never reported: nothing would score the trial
                    f"{self.name}.fit(hp, model, ...) did not pass its **kwargs on to model.fit: they hold the "
                    "callbacks that report each epoch (KerasTuner's checkpointing needs them too); call "
                    "model.fit(..., **kwargs)"
                )
            return self.result

        return fit

    def report_event(self) -> dict[str, Any]:
        """The log event the study reads the trial's report from."""
        report = self.report()
        values = ", ".join(f"{k}={val}" for k, val in report["hyperparameters"]["values"].items())
        return {"message": f"trial fitted with {values}"[:4000], "trial": report}

    def report(self) -> dict[str, Any]:
        """The trial's report once its fit ended: its hyperparameters as the fit left them, and what a HyperModel.fit
        returned when that was not a History (a dict of metrics, or the objective's value, as KerasTuner takes)."""
        import keras

        out: dict[str, Any] = {"hyperparameters": self.hp.get_config()}
        result = self.result
        if self.fit_args is None or isinstance(result, keras.callbacks.History):
            return out
        name = self.name
        if isinstance(result, dict):
            out["metrics"] = {str(k): _finite(v, f"{name}.fit's {k!r}") for k, v in result.items()}
        elif isinstance(result, numbers.Real) or (hasattr(result, "shape") and getattr(result, "shape", None) == ()):
            out["value"] = _finite(result, f"what {name}.fit returned")
        else:
            raise RuntimeError(
                f"{name}.fit returned {'None' if result is None else type(result).__name__}: return model.fit's "
                "History, a dict of metrics, or the objective's value, as KerasTuner needs"
            )
        return out


def trial_run(trial: TrialBuild) -> TrialRun:
    """The trial's HyperModel (made again from its constructor arguments) or build function, and its
    hyperparameters: the study's space set to the trial's values."""
    try:
        import keras_tuner as kt
    except ImportError:
        raise RuntimeError(
            "keras-tuner is not installed on this machine: add requirements=['keras-tuner'] to the search (the "
            "kernel's version), or install it where the worker runs"
        ) from None
    module, _, name = trial.build.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    hypermodel = None
    if trial.arguments is not None:
        if not (isinstance(found, type) and issubclass(found, kt.HyperModel)):
            raise RuntimeError(f"the job's code has no keras_tuner.HyperModel {name!r} in {module}: the study's")
        hypermodel = found(**trial.arguments)
    elif not callable(found):
        raise RuntimeError(f"the job's code has no function {name!r} in {module}: the study's build function")
    hp = kt.HyperParameters.from_config(trial.hyperparameters)
    hp.values = dict(trial.values)
    build = found if hypermodel is None else hypermodel.build
    return TrialRun(name, build, hypermodel, hp, trial.fit_args)


def build_trial_model(
    trial: TrialBuild, path: Path, earlier: Callable[[str, int | None], Path], objects: dict[str, Any]
) -> TrialRun:
    """Build, check and save the trial's model at `path`, its classes Keras cannot describe saved as the kernel
    saves them (`objects`, the job's resolved object references). A trial that resumes an earlier one (Hyperband's
    next round, whose epochs and initial_epoch the study put in the job's fit) starts from that trial's checkpoint,
    fetched by `earlier(job_id, epoch)`, as KerasTuner's Hyperband loads it. A HyperModel with its own fit may
    return a model it compiles (or trains with a loop of its own) there."""
    from aibro_core.kerasfile import keras_notes_quiet, saved_as, swaps_for

    run = trial_run(trial)
    model = run.build(run.hp)
    if trial.resume_job:
        start_from(model, earlier(trial.resume_job, trial.resume_epoch))
    if getattr(model, "optimizer", None) is None and run.fit_args is None:
        what = run.name if run.hypermodel is None else f"{run.name}.build"
        raise RuntimeError(
            f"{what}(hp) returned a model that is not compiled: call model.compile(...) in it, as KerasTuner needs"
        )
    with saved_as(swaps_for(model, objects)), keras_notes_quiet():
        model.save(path)
    return run


def start_from(model: Any, saved: Path) -> None:
    """The earlier trial's weights into the freshly built `model`, as KerasTuner's Hyperband loads them: a model
    with no Input (built on its first call) is built first from the earlier model's own build config, and the
    optimizer starts afresh (KerasTuner's load_weights skips an unbuilt optimizer's state; so does this, quietly)."""
    if not model.built:
        with zipfile.ZipFile(saved) as archive:
            build_config = json.loads(archive.read("config.json")).get("build_config")
        if build_config:
            model.build_from_config(build_config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        model.load_weights(saved)


class _quiet_fit:
    """While a HyperModel.fit runs, `model.fit` defaults to verbose=0, as the worker's own fit call does: a progress
    bar printed on a worker is only noise in the job's log (a verbose the user's fit passes still wins)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        model = self.model
        own = type(model).fit

        def fit(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("verbose", 0)
            return own(model, *args, **kwargs)

        model.fit = fit

    def __exit__(self, *exc: object) -> None:
        del self.model.fit


def _finite(value: Any, what: str) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RuntimeError(f"{what} is a {type(value).__name__}, not a number") from None
    return number if math.isfinite(number) else None
