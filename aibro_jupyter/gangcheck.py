"""What a job of several workers can run, decided in the kernel before anything is uploaded (issue 37).

Such a job trains with Keras on the JAX backend (the TensorFlow route across machines is blocked upstream:
keras-team/keras#20585), so a model whose own code calls TensorFlow (`tf.GradientTape` in a `train_step`, `tf.*` ops
in a layer) cannot take it: each class or function of the user's that the model names is read, and a name in it
that stands for TensorFlow is refused with the piece and its line. Models built from Keras layers and `keras.ops`
pass. The fit itself takes arrays and the arguments below; anything else is refused by name with the way out
(`--workers 1` runs it as it runs today)."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from typing import Any

import numpy as np

from aibro_core.bounds import MAX_WORKERS
from aibro_core.models import GANG_CALLBACKS

from .cellcode import definition_source, is_cell_object
from .dataset_blob import is_dataset
from .errors import ValidationError
from .fitrequest import FitRequest

GANG_FIT_ARGS = {
    "epochs",
    "batch_size",
    "shuffle",
    "initial_epoch",
    "verbose",
    "sample_weight",
    "validation_split",
    "validation_batch_size",
    "callbacks",
}

"""What a gang's fit takes (the worker's gangrun.FIT_ARGS, with sample_weight, which travels as data)."""
KERAS_DEFAULT_BATCH = 32


def check_workers(request: FitRequest) -> None:
    """The data and the fit's arguments of a job of `request.workers` workers; no-op for one worker."""
    workers, flag = request.workers, (request.argnames or {}).get("workers", "workers")
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ValidationError(f"{flag} must be an integer from 1 to {MAX_WORKERS}, not {workers!r}")
    if workers == 1:
        return
    way_out = f"or train with {flag} 1"
    if is_dataset(request.train_X):
        _check_dataset(request.train_X, "x", workers, flag, way_out)
    if is_dataset(request.validation_data):
        _check_dataset(request.validation_data, "validation_data", workers, flag, way_out)
    arrays = [("y", request.train_Y), ("sample_weight", request.sample_weight)]
    if not is_dataset(request.train_X):
        arrays.insert(0, ("x", request.train_X))
    for name, value in arrays:
        if value is not None and not isinstance(value, np.ndarray):
            raise ValidationError(
                f"{flag} {workers} takes NumPy arrays for x, y and sample_weight; {name} is {type(value).__name__}: "
                f"pass one array each (np.asarray), {way_out}"
            )
    if request.train_X is None:
        raise ValidationError(f"{flag} {workers} needs the training inputs x as a NumPy array")
    held_out = request.validation_data
    if (
        held_out is not None
        and not is_dataset(held_out)
        and not (
            isinstance(held_out, (tuple, list))
            and 2 <= len(held_out) <= 3
            and all(part is None or isinstance(part, np.ndarray) for part in held_out)
        )
    ):
        raise ValidationError(
            f"{flag} {workers} takes validation_data as a tuple of NumPy arrays (x_val, y_val[, sample_weight]); "
            f"this one is {type(held_out).__name__}: pass arrays, {way_out}"
        )
    others = sorted(set(request.fit_kwargs or {}) - GANG_FIT_ARGS)
    if others:
        raise ValidationError(
            f"{flag} {workers} does not take the fit argument {others[0]!r} yet (it takes "
            f"{', '.join(sorted(GANG_FIT_ARGS))}): drop it, {way_out}"
        )
    for callback in (request.fit_kwargs or {}).get("callbacks") or []:
        kind = type(callback)
        if not (kind.__module__.startswith("keras") and kind.__name__ in GANG_CALLBACKS):
            raise ValidationError(
                f"{flag} {workers} runs the callbacks {', '.join(GANG_CALLBACKS)} on every worker, and not yet "
                f"{kind.__name__}: leave it out (save the returned model yourself), {way_out}"
            )
    batch = request.batch_size if request.batch_size is not None else KERAS_DEFAULT_BATCH
    sizes = (("batch_size", batch), ("validation_batch_size", (request.fit_kwargs or {}).get("validation_batch_size")))
    for name, size in sizes:
        if isinstance(size, int) and size % workers:
            raise ValidationError(
                f"{name} {size} is not a multiple of the {workers} workers: each takes an equal part of every "
                f"batch; use a batch size such as {max(workers, size - size % workers)}"
            )
    rows = None if is_dataset(request.train_X) else len(request.train_X)
    if rows is not None and rows < workers:
        raise ValidationError(f"{rows} rows cannot feed {workers} workers")


def _check_dataset(ds: Any, name: str, workers: int, flag: str, way_out: str) -> None:
    """A tf.data dataset of (x, y[, sample_weight]) batches, each a tensor: the workers split every batch as they
    split arrays' (its batch size, where the dataset says it, a multiple of N)."""
    spec = ds.element_spec
    parts = spec if isinstance(spec, tuple) else (spec,)
    if not 1 <= len(parts) <= 3 or not all(hasattr(p, "shape") and hasattr(p, "dtype") for p in parts):
        raise ValidationError(
            f"{flag} {workers} takes a dataset of (x, y[, sample_weight]) tensors; {name}'s elements are {spec}: "
            f"map them to a tuple of tensors, {way_out}"
        )
    batch = parts[0].shape[0] if parts[0].shape.rank else None
    if batch is None:  # not in the spec (a last batch may be short): the first batch says, as the upload reads it
        first = next(iter(ds.take(1)), None)
        batch = len((first if isinstance(first, tuple) else (first,))[0]) if first is not None else None
    if batch is not None and batch % workers:
        raise ValidationError(
            f"{name}'s batches of {batch} are not a multiple of the {workers} workers: each takes an equal part of "
            f"every batch; batch it by a multiple of {workers}, {way_out}"
        )


def check_model_code(workers: int, travelling: list[Any], flag: str = "workers") -> None:
    """Refuse, naming the piece, a class or function of the user's that calls TensorFlow (what Keras on JAX cannot
    run); `travelling` are the user's own objects the model names (kerasnames.plan_names(...).travel)."""
    if workers == 1:
        return
    for obj in travelling:
        found = tensorflow_use(obj)
        if found is not None:
            name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
            raise ValidationError(
                f"{flag} {workers} trains with Keras on JAX, and {name} calls TensorFlow ({found}): write it with "
                f"keras.ops (and Keras' own train_step), or train with {flag} 1"
            )


def tensorflow_use(obj: Any) -> str | None:
    """Where `obj`'s own source reads a name that stands for TensorFlow (`tf.reduce_sum (line 4)`), else None."""
    try:
        source = textwrap.dedent(definition_source(obj) if is_cell_object(obj) else inspect.getsource(obj))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, ValidationError):
        return None  # no source to read: the first step on the workers says what fails
    names = _namespace(obj)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and _is_tensorflow(names.get(node.id)):
            segment = ast.get_source_segment(source, _outermost(tree, node)) or node.id
            return f"{segment.splitlines()[0][:80]} (line {node.lineno})"
    return None


def _namespace(obj: Any) -> dict[str, Any]:
    if isinstance(obj, types.FunctionType):
        return obj.__globals__
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    return vars(module) if module is not None else {}


def _is_tensorflow(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] == "tensorflow"
    return str(getattr(value, "__module__", "") or "").split(".")[0] == "tensorflow"


def _outermost(tree: ast.AST, name: ast.Name) -> ast.AST:
    """The attribute chain a name starts (`tf.math.reduce_sum` for `tf`), for the message."""
    best: ast.AST = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner = node
            while isinstance(inner, ast.Attribute):
                inner = inner.value
            if inner is name and len(ast.dump(node)) > len(ast.dump(best)):
                best = node
    return best
