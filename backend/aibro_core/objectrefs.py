"""The user's objects a job names, found again where it runs (the writing side is aibro_jupyter/argcodec.py and
kerasnames.py): values written as JSON decoded, and every class or function Keras records by name in the model
(registered or not, a closure included) resolved from the job's travelling code, for each Keras load of the job.
The worker resolves them from the travelling code; a kernel attaching to a job without its model object, from its
own namespace (`aliases` maps the travelling module of notebook cells to `__main__`).

A model made of models comes back as `aibro_core.kerasfile.rebuildable` of the user's class, so Keras saves and
loads it as any model."""

from __future__ import annotations

import importlib
import types
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .kerasfile import rebuildable
from .models import Closure, ObjectRef


class Files(Protocol):
    """Where a callback's file and folder arguments are written on the worker (usercallbacks.FileReturn)."""

    root: Path
    bases: dict[str, str]


def decode(value: Any, files: Files | None, slot: str, aliases: dict[str, str] | None = None) -> Any:
    """A value as the kernel encoded it (argcodec.encode): literals, and the marked forms."""
    if isinstance(value, list):
        return [decode(v, files, slot, aliases) for v in value]
    if not isinstance(value, dict):
        return value
    if "__path__" in value:
        return _path(value, files, slot)
    if "__function__" in value:
        return find(str(value["__function__"]), aliases)
    if "__closure__" in value:
        return closure(value["__closure__"], aliases)
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(decode(v, files, slot, aliases) for v in value["__tuple__"])
    if "__array__" in value:
        spec = value["__array__"]
        data = [decode(v, None, slot) for v in spec["data"]]
        return np.asarray(data, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
    if "__keras__" in value:
        import keras

        return keras.saving.deserialize_keras_object(value["__keras__"])
    return {k: decode(v, files, slot, aliases) for k, v in value.items()}


def _path(value: dict[str, Any], files: Files | None, slot: str) -> str:
    if files is None:
        raise ValueError(f"{slot}: only a callback's argument may name a file")
    folder = files.root / slot
    folder.mkdir(parents=True, exist_ok=True)
    kernel = str(value["kernel"])
    if value["__path__"] == "dir":
        files.bases[str(folder)] = kernel
        return str(folder)
    files.bases[str(folder)] = str(Path(kernel).parent)
    return str(folder / Path(kernel).name)


def find(ref: str, aliases: dict[str, str] | None = None) -> Any:
    """`module:qualified.name` from the travelling code or an installed package."""
    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module((aliases or {}).get(module, module))
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def closure(spec: Closure | dict[str, Any], aliases: dict[str, str] | None = None) -> Any:
    """A function made inside another, made again: its code found inside the enclosing function's (by name and line
    within it), with the enclosing module's globals and the values it closed over in the kernel. A closure marked
    in a callback's or compile's arguments (`{"__closure__": ...}`) is validated here as a job's objects are."""
    if not isinstance(spec, Closure):
        spec = Closure.model_validate(spec)
    outer = find(spec.ref, aliases)
    outer_code = outer.__code__
    line = spec.line + outer_code.co_firstlineno
    code = _inner_code(outer_code, spec.name, line, spec.nth)
    if code is None:
        raise RuntimeError(
            f"{spec.ref} holds no function {spec.name} in the job's code: the travelling code differs from the "
            "kernel's; run the cell that defines it again and resubmit"
        )
    cells = tuple(types.CellType(decode(spec.cells[name], None, "closure", aliases)) for name in code.co_freevars)
    defaults = tuple(decode(spec.defaults, None, "closure", aliases)) if spec.defaults else None
    fn = types.FunctionType(code, outer.__globals__, code.co_name, defaults, cells)
    if spec.kwdefaults:
        fn.__kwdefaults__ = decode(spec.kwdefaults, None, "closure", aliases)
    fn.__qualname__ = getattr(code, "co_qualname", code.co_name)
    fn.__module__ = outer.__module__
    return fn


def _inner_code(code: types.CodeType, name: str, line: int, nth: int) -> types.CodeType | None:
    """The `nth` code object named `name` starting on `line` inside `code` (depth first, as the kernel counted)."""
    found: list[types.CodeType] = []

    def walk(c: types.CodeType) -> None:
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == name and const.co_firstlineno == line:
                    found.append(const)
                walk(const)

    walk(code)
    return found[nth] if nth < len(found) else None


def resolve(refs: dict[str, ObjectRef] | dict[str, Any], aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """The custom objects of a job's Keras loads: each name Keras records in the model, the object it stands for
    (a job's spec holds them validated; the kernel's own, read from a saved file's notes, are validated here)."""
    found: dict[str, Any] = {}
    for name, given in refs.items():
        ref = given if isinstance(given, ObjectRef) else ObjectRef.model_validate(given)
        try:
            obj = closure(ref.closure, aliases) if ref.closure is not None else find(str(ref.ref), aliases)
        except (ImportError, AttributeError) as exc:
            where = ref.closure.ref if ref.closure is not None else ref.ref
            raise RuntimeError(
                f"the model names {name} ({where}), which the job's code does not define ({exc}): run the cells that "
                "define it before submitting, or install its package with the job's requirements"
            ) from None
        if ref.init is not None or ref.config_args:
            obj = rebuildable(obj, dict(ref.init or {}), tuple(ref.config_args or ()))
        found[name] = obj
    return found
