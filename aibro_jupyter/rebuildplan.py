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

import ast
import inspect
import os
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aibro_core.compat import keras as keras_compat

from .argcodec import check_importable, encode, module_of
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
            check_importable(cls, f"callback {name}")
            plan.objects.append(cls)
        args = _arguments(cb, name, plan, namespace)
        spec: dict[str, Any] = {"class": name, "config": args}
        if not own:
            spec["module"] = module_of(cls)
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
            args[param.name] = encode(value, where, plan.objects, namespace)
    return args


def kept_arguments(
    obj: Any, method: Any, what: str, where: str, name: str = "", given: dict[str, Any] | None = None
) -> Iterator[tuple[Any, Any]]:
    """The named parameters of `method` with the value `obj` keeps for each: the attribute `method` assigns it to
    (`self.loss_fn = loss_fn`), what Keras' own compile() was `given` of it, or an attribute of the same name (or the
    one Keras keeps it under); one kept nowhere is skipped when it has a default, refused otherwise."""
    assigned = assigned_attributes(method)
    for param in list(inspect.signature(method).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in assigned:
            value = getattr(obj, assigned[param.name], inspect.Parameter.empty)
        elif given is not None and param.name in given:
            value = given[param.name]
        else:
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


def assigned_attributes(method: Any) -> dict[str, str]:
    """`self.<attribute> = <argument>` statements in a method's source: argument → attribute (the first one)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return {}
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self":
                        found.setdefault(node.value.id, target.attr)
    return found


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _kernel_path(value: Any, where: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValidationError(f"{where} must be a path, got {type(value).__name__}")
    return str(Path(value).expanduser().absolute())


def plan_compile(model: Any, plan: CallbackPlan, namespace: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The arguments of a compile() the model's class overrides, read back from the model (each kept as an
    attribute of the same name), for the worker to call it again; None when the model uses Keras' own compile."""
    import keras

    compile_fn = type(model).compile
    if compile_fn is keras.Model.compile or getattr(compile_fn, "__module__", "").startswith("keras"):
        return None
    name = f"{type(model).__name__}.compile"
    given = dict(keras_compat.compile_config(model))  # super().compile()'s
    return {
        param.name: encode(value, f"{name}'s argument '{param.name}'", plan.objects, namespace)
        for param, value in kept_arguments(model, compile_fn, name, "compile", given=given)
    }
