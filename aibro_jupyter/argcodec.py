"""A value as the worker rebuilds it: the arguments of callbacks, of a custom compile(), of a model made of models,
and the free variables of a closure, written as JSON (aibro_backend/worker/objects.py reads them back).

Literals stay JSON; a tuple, a small array and a non-finite float are marked; a Keras object (optimizer, loss,
metric, layer...) travels as its Keras config; a function travels as a reference to code that travels with the job:
a top-level one by `module:name`, a closure (`def loss(margin): def contrastive_loss(...)`) as its enclosing
function's name, where its code sits in it, and the values it closes over. Anything else is refused, named, before
anything is uploaded. Nothing is pickled."""

from __future__ import annotations

import math
import numbers
import sys
import types
from typing import Any

import numpy as np

from .cellcode import MAIN_MODULE, is_cell_object, is_lambda, travel_name
from .errors import ValidationError

MAX_ITEMS = 100_000  # the spec's JSON bound (models.MAX_SPEC_CHARS) is the real limit
MAX_ARRAY_ITEMS = 65536
MAX_DEPTH = 8


def encode(value: Any, where: str, objects: list[Any], namespace: dict[str, Any] | None, depth: int = 0) -> Any:
    """`value` as JSON the worker decodes; the classes and functions whose code must travel are added to `objects`."""
    if depth > MAX_DEPTH:
        raise ValidationError(f"{where} nests lists and dicts more than {MAX_DEPTH} levels deep: pass a flatter value")
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else {"__float__": str(float(value))}
    if isinstance(value, list) and len(value) <= MAX_ITEMS:
        return [encode(v, f"{where}[{i}]", objects, namespace, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple) and len(value) <= MAX_ITEMS:
        return {"__tuple__": [encode(v, f"{where}[{i}]", objects, namespace, depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, dict) and len(value) <= MAX_ITEMS and all(isinstance(k, str) for k in value):
        return {k: encode(v, f"{where}[{k!r}]", objects, namespace, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, dict)):
        raise ValidationError(
            f"{where} holds {len(value)} items, more than {MAX_ITEMS} travel in a job's arguments: load it where it "
            "is used (in the callback's on_train_begin, say), or pass it as the fit's data"
        )
    if isinstance(value, np.ndarray):
        return _array(value, where)
    if is_keras_object(value):
        import keras

        objects.append(type(value))
        return {"__keras__": keras.saving.serialize_keras_object(value)}
    if isinstance(value, types.FunctionType):
        return function_ref(value, where, objects, namespace)
    raise ValidationError(
        f"{where} is a {type(value).__module__}.{type(value).__name__}, which cannot travel to the worker: pass "
        "numbers, strings, tuples, lists, dicts, small arrays or functions (defined in the notebook or a module next "
        "to it), and build anything else where it is used"
    )


def _array(arr: np.ndarray, where: str) -> dict[str, Any]:
    if arr.dtype.kind not in "biufU" or arr.size > MAX_ARRAY_ITEMS:
        raise ValidationError(
            f"{where} is an array of {arr.size} {arr.dtype} values: only numeric or text arrays of at most "
            f"{MAX_ARRAY_ITEMS} values travel this way; pass a bigger array as the fit's data, or load it where it "
            "is used"
        )
    data = arr.reshape(-1).tolist()
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        data = [v if math.isfinite(v) else {"__float__": str(v)} for v in data]
    return {"__array__": {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": data}}


def is_keras_object(value: Any) -> bool:
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


# -- functions -----------------------------------------------------------------------------------------
def function_ref(fn: Any, where: str, objects: list[Any], namespace: dict[str, Any] | None) -> dict[str, Any]:
    """A function as the worker finds it: `{"__function__": "module:name"}` for one defined at the top of a cell or
    module (a lambda in a cell by the variable holding it), `{"__closure__": ...}` for one defined inside another."""
    if is_closure(fn):
        return {"__closure__": closure_ref(fn, where, objects, namespace)}
    check_importable(fn, where)
    objects.append(fn)
    return {"__function__": f"{module_of(fn)}:{name_in_module(fn, namespace)}"}


def is_closure(fn: Any) -> bool:
    """A function defined inside another function (whether or not it closes over anything)."""
    return isinstance(fn, types.FunctionType) and "<locals>" in fn.__qualname__


def closure_ref(fn: Any, where: str, objects: list[Any], namespace: dict[str, Any] | None) -> dict[str, Any]:
    """The enclosing top-level function (its code travels), the inner function's name and line within it, and what
    it closes over: `loss(margin=1)`'s `contrastive_loss` is made again on the worker with margin=1."""
    outer_qual = fn.__qualname__.split(".<locals>.")[0]
    outer = _top_level(fn.__module__, outer_qual, namespace)
    outer_code = getattr(outer, "__code__", None)
    if outer_code is None or not _holds(outer_code, fn.__code__):
        raise ValidationError(
            f"{where} is {fn.__name__}, made inside {outer_qual}(), but {outer_qual} is no longer the function that "
            f"made it (redefined since?): run the cell that defines {outer_qual} and the one that calls it again"
        )
    owner = outer_qual.split(".")[0]
    holder = outer if owner == outer_qual else _top_level(fn.__module__, owner, namespace)
    check_importable(holder, f"{where} (made inside {outer_qual})")
    objects.append(holder)
    module = module_of(holder)
    prefix = name_in_module(holder, namespace) if module == MAIN_MODULE else owner
    inner = f"{where}, the function {fn.__name__} made inside {outer_qual}()"
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            content = cell.cell_contents
        except ValueError:
            raise ValidationError(f"{inner}, closes over `{name}`, which has no value yet") from None
        cells[name] = _cell(content, f"{inner}, closes over `{name}`", objects, namespace)
    ref: dict[str, Any] = {
        "ref": f"{module}:{prefix}{outer_qual[len(owner) :]}",
        "name": fn.__code__.co_name,
        "line": fn.__code__.co_firstlineno - outer_code.co_firstlineno,
        "cells": cells,
    }
    nth = [c for c in inner_codes(outer_code) if _same_place(c, fn.__code__)].index(fn.__code__)
    if nth:
        ref["nth"] = nth  # the second lambda on one line
    if fn.__defaults__:
        ref["defaults"] = [_cell(v, f"{inner}, a default", objects, namespace) for v in fn.__defaults__]
    if fn.__kwdefaults__:
        ref["kwdefaults"] = {
            k: _cell(v, f"{inner}, the default of {k}", objects, namespace) for k, v in fn.__kwdefaults__.items()
        }
    return ref


def _cell(value: Any, where: str, objects: list[Any], namespace: dict[str, Any] | None) -> Any:
    try:
        return encode(value, where, objects, namespace, 1)
    except ValidationError as exc:
        raise ValidationError(
            f"{where}: a {type(value).__module__}.{type(value).__name__}, which cannot travel with the function (a "
            "closure's values travel when they are numbers, strings, tuples, small arrays, Keras objects or "
            f"functions; here: {exc}): pass it as an argument where the function is called, or make it a plain value"
        ) from None


def _holds(code: types.CodeType, inner: types.CodeType) -> bool:
    return any(c is inner for c in inner_codes(code))


def inner_codes(code: types.CodeType) -> list[types.CodeType]:
    """Every code object compiled inside `code`, depth first in the order they stand (the worker walks the same)."""
    found = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.append(const)
            found += inner_codes(const)
    return found


def _same_place(a: types.CodeType, b: types.CodeType) -> bool:
    return a.co_name == b.co_name and a.co_firstlineno == b.co_firstlineno


def _top_level(module: str, qualname: str, namespace: dict[str, Any] | None) -> Any:
    """The object `qualname` names at the top of `module` (a method through its class)."""
    parts = qualname.split(".")
    if module == "__main__":
        ns = namespace if namespace is not None else vars(sys.modules["__main__"])
        obj: Any = ns.get(parts[0])
    else:
        obj = getattr(sys.modules.get(module), parts[0], None)
    for part in parts[1:]:
        obj = getattr(obj, part, None)
    if obj is None:
        raise ValidationError(
            f"{qualname} (in {module}) is not defined at the top level of the notebook or its module any more, so "
            "the worker cannot find the functions made inside it: define it at the top level of a cell"
        )
    return obj


def module_of(obj: Any) -> str:
    return MAIN_MODULE if is_cell_object(obj) else str(obj.__module__)


def name_in_module(obj: Any, namespace: dict[str, Any] | None) -> str:
    if is_cell_object(obj):
        return travel_name(obj, namespace)
    return str(obj.__qualname__)


def check_importable(obj: Any, where: str) -> None:
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
