"""What the worker rebuilds from arguments, decided before anything is uploaded: the fit's callbacks, and the
arguments of a model's own compile().

Every callback is rebuilt on the worker from its class and its constructor arguments, read back from the object
(Keras' callbacks and most users' keep each argument as an attribute of the same name). Keras' own classes come
from Keras; the user's own Callback subclasses travel as source, as custom layers do, and so do the functions a
callback is given (a LearningRateScheduler's schedule, a LambdaCallback's hooks, lambdas included). A file or
folder argument (ModelCheckpoint's filepath, CSVLogger's filename, TensorBoard's log_dir) is written on the worker
and comes back to the kernel-side path while the job runs. A subclassed model whose compile() takes arguments of
its own (a GAN's two optimizers and its loss function) is compiled again on the worker with them: Keras' saved
model does not keep them. Keras objects travel as their Keras config; nothing is pickled."""

from __future__ import annotations

import inspect
import math
import numbers
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .bundle import registered_in
from .cellcode import MAIN_MODULE, is_cell_object, is_lambda, travel_name
from .errors import ValidationError

# Keras callbacks whose argument is a file (its name may hold {epoch} and metric fields) or a folder on disk.
PATH_ARGS = {
    ("ModelCheckpoint", "filepath"): "file",
    ("CSVLogger", "filename"): "file",
    ("TensorBoard", "log_dir"): "dir",
}
# Arguments Keras keeps under another attribute name.
ATTRIBUTE_OF = {("CSVLogger", "separator"): "sep"}
# Keras callbacks that do not travel, and why; the cell says so before the upload.
NOT_RUN = {
    "History": None,  # fit returns a History anyway: the remote one comes back as it
    "ProgbarLogger": None,  # the cell prints every epoch's line
    "BackupAndRestore": "BackupAndRestore is not run: the worker checkpoints every epoch and a job whose machine "
    "goes away resumes from its last checkpoint by itself (backup_dir is not written)",
}
REFUSED = {
    "RemoteMonitor": "RemoteMonitor posts every epoch to a server of yours, which a worker cannot reach (it talks "
    "only to the backend): drop it and follow the job with %cloud_attach, Training.attach or the sidebar",
}
MAX_ARG_ITEMS = 1000


@dataclass
class CallbackPlan:
    """What travels in the job spec, the code that must travel with it, and what the cell says beforehand."""

    specs: list[dict[str, Any]] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_callbacks(callbacks: Any, namespace: dict[str, Any] | None = None) -> CallbackPlan:
    import keras

    plan = CallbackPlan()
    if callbacks is None:
        return plan
    if not isinstance(callbacks, (list, tuple)):
        raise ValidationError(f"callbacks must be a list of keras.callbacks.Callback, got {type(callbacks).__name__}")
    for cb in callbacks:
        cls = type(cb)
        name = cls.__name__
        if not isinstance(cb, keras.callbacks.Callback):
            raise ValidationError(
                f"callbacks holds a {cls.__module__}.{name}, which is not a keras.callbacks.Callback: subclass "
                "keras.callbacks.Callback"
            )
        own = cls.__module__.startswith("keras")
        if own and name in NOT_RUN:
            if NOT_RUN[name]:
                plan.notes.append(str(NOT_RUN[name]))
            continue
        if own and name in REFUSED:
            raise ValidationError(REFUSED[name])
        if not own:
            _check_importable(cls, f"callback {name}")
            plan.objects.append(cls)
        args = _arguments(cb, name, plan, namespace)
        spec: dict[str, Any] = {"class": name, "config": args}
        if not own:
            spec["module"] = _module_of(cls)
        plan.specs.append(spec)
    return plan


def _arguments(cb: Any, name: str, plan: CallbackPlan, namespace: dict[str, Any] | None) -> dict[str, Any]:
    """Each constructor argument as it stands on the object now, encoded; defaults are left out."""
    args: dict[str, Any] = {}
    for param, value in kept_arguments(cb, type(cb).__init__, f"callback {name}", "__init__", name):
        if value is param.default or (_plain(value) and _plain(param.default) and value == param.default):
            continue
        where = f"callback {name}'s argument '{param.name}'"
        kind = PATH_ARGS.get((name, param.name))
        if kind is not None:
            args[param.name] = {"__path__": kind, "kernel": _kernel_path(value, where)}
        else:
            args[param.name] = _encode(value, where, plan, namespace, 0)
    return args


def kept_arguments(obj: Any, method: Any, what: str, where: str, name: str = "") -> Iterator[tuple[Any, Any]]:
    """The named parameters of `method` with the value `obj` keeps for each (an attribute of the same name, or the
    one Keras keeps it under); one it keeps none of is skipped when it has a default, refused otherwise."""
    for param in list(inspect.signature(method).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = getattr(obj, ATTRIBUTE_OF.get((name, param.name), param.name), inspect.Parameter.empty)
        if inspect.ismethod(value) and value.__self__ is obj:
            continue  # a LambdaCallback hook that was not given: the class's own no-op
        if value is inspect.Parameter.empty:
            if param.default is inspect.Parameter.empty:
                raise ValidationError(
                    f"{what} takes the argument '{param.name}' but keeps no attribute of that name, so the worker "
                    f"cannot rebuild it: store it in {where}() (self.{param.name} = {param.name})"
                )
            continue
        yield param, value


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _kernel_path(value: Any, where: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValidationError(f"{where} must be a path, got {type(value).__name__}")
    return str(Path(value).expanduser().absolute())


def _encode(value: Any, where: str, plan: CallbackPlan, namespace: dict[str, Any] | None, depth: int) -> Any:
    """Literals as JSON; a function as a reference to travelling code; anything else is refused, named."""
    if depth > 8:
        raise ValidationError(f"{where} nests lists and dicts more than 8 levels deep: pass a flatter value")
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else {"__float__": str(float(value))}
    if isinstance(value, (list, tuple)) and len(value) <= MAX_ARG_ITEMS:
        return [_encode(v, f"{where}[{i}]", plan, namespace, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict) and len(value) <= MAX_ARG_ITEMS and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{where}[{k!r}]", plan, namespace, depth + 1) for k, v in value.items()}
    if _is_keras_object(value):
        import keras

        config = keras.saving.serialize_keras_object(value)
        plan.objects += [obj for _, obj in registered_in(config, where)]
        return {"__keras__": config}
    if isinstance(value, types.FunctionType):
        _check_importable(value, where)
        plan.objects.append(value)
        return {"__function__": f"{_module_of(value)}:{_name_in_module(value, namespace)}"}
    raise ValidationError(
        f"{where} is a {type(value).__module__}.{type(value).__name__}, which cannot travel to the worker: pass "
        "numbers, strings, lists, dicts or functions (defined in the notebook or a module next to it), and build "
        "anything else inside the callback"
    )


def _is_keras_object(value: Any) -> bool:
    """An optimizer, loss, metric, layer, initializer...: what Keras itself serializes to a config and back."""
    import keras

    kinds = (
        keras.optimizers.Optimizer,
        keras.losses.Loss,
        keras.metrics.Metric,
        keras.layers.Layer,
        keras.initializers.Initializer,
        keras.regularizers.Regularizer,
        keras.constraints.Constraint,
        keras.optimizers.schedules.LearningRateSchedule,
    )
    return isinstance(value, kinds)


def plan_compile(model: Any, plan: CallbackPlan, namespace: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The arguments of a compile() the model's class overrides, read back from the model (each kept as an
    attribute of the same name), for the worker to call it again; None when the model uses Keras' own compile."""
    import keras

    compile_fn = type(model).compile
    if compile_fn is keras.Model.compile or getattr(compile_fn, "__module__", "").startswith("keras"):
        return None
    name = f"{type(model).__name__}.compile"
    return {
        param.name: _encode(value, f"{name}'s argument '{param.name}'", plan, namespace, 0)
        for param, value in kept_arguments(model, compile_fn, name, "compile")
    }


def _module_of(obj: Any) -> str:
    return MAIN_MODULE if is_cell_object(obj) else str(obj.__module__)


def _name_in_module(fn: Any, namespace: dict[str, Any] | None) -> str:
    if is_cell_object(fn):
        return travel_name(fn, namespace)
    return str(fn.__qualname__)


def _check_importable(obj: Any, where: str) -> None:
    """A class or function the worker finds by name: defined at the top level of a cell or a module."""
    qual = str(getattr(obj, "__qualname__", ""))
    if is_cell_object(obj) and is_lambda(obj) and obj.__closure__ is None:
        return  # a lambda in a cell travels as its own text, wherever it was written, if it closes over nothing
    if "<locals>" in qual or ("." in qual and not is_cell_object(obj)):
        raise ValidationError(
            f"{where} ({qual}) is defined inside another function or class, so the worker cannot find it by name: "
            "define it at the top level of a cell or of a module next to the notebook"
        )
    if not is_cell_object(obj) and "<lambda>" in qual:
        raise ValidationError(
            f"{where} is a lambda from module {obj.__module__}: give it a name there (def ...) so the worker can "
            "import it"
        )
