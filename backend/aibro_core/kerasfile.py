"""A model's `.keras` file for what Keras' own save leaves out, the same in the kernel and on the worker.

* A model made of models (a VAE of an encoder and a decoder, a distiller, a GAN) has no config Keras can write:
  its `__init__` takes other models. `rebuildable` makes a subclass whose config is those constructor arguments
  (Keras serializes the sub-models as their own configs) and whose `from_config` calls the user's class with them
  again, so such a model saves, loads, checkpoints and resumes as any other.
* Keras loads an optimizer's state only into an optimizer that was built, and builds only `model.optimizer` (over
  every trainable variable, and only for a built model). A GAN's `d_optimizer` and `g_optimizer`, or the optimizer
  of a model that was never called, lose their state on load. `note_optimizers` records, in the file's
  metadata, which of the model's weights each optimizer steps; `restore_optimizers` builds each one over those and
  loads its state from the file.

Keras is imported only inside functions: the backend imports this package without it."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .compat import keras as keras_compat

WEIGHTS = "model.weights.h5"
METADATA = "metadata.json"
NOTE_KEY = "aibro"
# What Keras says while saving or loading that the callers deal with themselves: a model with no call() is never
# "built"; an optimizer built after the save (restore_optimizers loads it); a custom compile() called again with the
# model's own arguments; NumPy 2 asking Keras' variables for a copy keyword; a layer without build() rebuilt from its
# saved shape (the kernel's fit, which never loads, says none of this).
KERAS_NOTES = (
    "You are saving a model that has not yet been built",
    "Skipping variable loading for optimizer",
    "`compile()` was not called as part of model loading",
    "__array__ implementation doesn't accept a copy keyword",
    "`build()` was called on layer",
)


def rebuildable(cls: type, init: dict[str, str], config_args: tuple[str, ...] = ()) -> type:
    """A subclass of the user's `cls` that Keras can save and load: its config is the constructor arguments `init`
    names, each read back from the object's attribute that `init` maps it to, and those of `config_args` as the
    class's own get_config gives them (Keras' automatic config of plain arguments, the ones kept nowhere else);
    `from_config` deserializes each and calls the class with them, and nothing else of a config (a Keras-written
    name or dtype the class's __init__ does not take). One class per (cls, init, config_args)."""
    key = (cls, tuple(sorted(init.items())), tuple(sorted(config_args)))
    if key not in _REBUILDABLE:
        _REBUILDABLE[key] = _make_rebuildable(cls, dict(init), tuple(sorted(config_args)))
    return _REBUILDABLE[key]


_REBUILDABLE: dict[tuple[type, tuple[tuple[str, str], ...], tuple[str, ...]], type] = {}


def _make_rebuildable(cls: type, init: dict[str, str], config_args: tuple[str, ...]) -> type:
    import keras

    def get_config(self: Any) -> dict[str, Any]:
        own = _own_config(self, cls) if config_args else {}
        config = {name: own[name] for name in config_args if name in own}
        config.update({name: getattr(self, attribute) for name, attribute in init.items()})
        return config

    def from_config(klass: type, config: dict[str, Any], custom_objects: Any = None) -> Any:
        taken = set(init) | set(config_args)
        return klass(**{name: _deserialized(value) for name, value in config.items() if name in taken})

    def _deserialized(value: Any) -> Any:
        if isinstance(value, dict) and "class_name" in value:
            return keras.saving.deserialize_keras_object(value)
        if isinstance(value, list):
            return [_deserialized(v) for v in value]
        return value

    body = {
        "get_config": get_config,
        "from_config": classmethod(from_config),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_aibro_init": (dict(init), config_args),
    }
    return type(cls.__name__, (cls,), body)


def _own_config(obj: Any, cls: type) -> dict[str, Any]:
    """The config the user's class gives (Keras writes its automatic one only for an object of a class that does not
    override get_config, so the object is seen as the user's class for the call)."""
    seen_as = obj.__class__
    obj.__class__ = cls
    try:
        return dict(obj.get_config())
    finally:
        obj.__class__ = seen_as


def init_of(cls: type) -> tuple[dict[str, str], tuple[str, ...]] | None:
    """(constructor arguments → attributes, arguments from the class's own config) of a class `rebuildable` made;
    None for any other class."""
    made = cls.__dict__.get("_aibro_init")
    return (dict(made[0]), tuple(made[1])) if isinstance(made, tuple) else None


def user_objects(model: Any) -> list[Any]:
    """The model, its layers, and the Keras objects compile() was given, where their class is the user's own: what
    may need saving as a rebuildable class."""
    import keras

    found = [model, *keras_compat.nested_layers(model)]
    stack = list(keras_compat.compile_config(model).values())
    kinds = (keras.losses.Loss, keras.metrics.Metric, keras.optimizers.Optimizer)
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, kinds):
            found.append(value)
    unique = list({id(o): o for o in found}.values())
    return [o for o in unique if str(type(o).__module__).split(".")[0] not in ("keras", "tensorflow", "tf_keras")]


def swaps_for(model: Any, objects: dict[str, Any]) -> list[tuple[Any, type]]:
    """Where a job's objects (objectrefs.resolve) make a class rebuildable, each of the model's objects of that class
    and the class to save it as: a model the worker built itself (a study's trial) saves as the kernel's would."""
    made = {cls.__bases__[0]: cls for cls in objects.values() if isinstance(cls, type) and init_of(cls) is not None}
    return [(obj, made[type(obj)]) for obj in user_objects(model) if type(obj) in made]


@contextlib.contextmanager
def saved_as(swaps: list[tuple[Any, type]]) -> Iterator[None]:
    """Each object seen as its rebuildable class for the length of the block (a save in the kernel), then as the
    user's own class again: the user's objects are never left changed."""
    done: list[tuple[Any, type]] = []
    try:
        for obj, cls in swaps:
            done.append((obj, obj.__class__))
            obj.__class__ = cls
        yield
    finally:
        for obj, cls in reversed(done):
            obj.__class__ = cls


@contextlib.contextmanager
def keras_notes_quiet() -> Iterator[None]:
    """Keras' notes about what the callers handle themselves (KERAS_NOTES) are not shown; every other warning is."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if not str(w.message).startswith(KERAS_NOTES):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# -- optimizers ---------------------------------------------------------------------------------------
def optimizers_of(model: Any) -> dict[str, Any]:
    """The model's optimizers by the attribute that holds them: `optimizer`, and any other a custom compile() or
    __init__ set (a GAN's d_optimizer and g_optimizer). These are the groups Keras saves them under."""
    import keras

    found = {}
    for name, value in sorted(vars(model).items()):
        if not name.startswith("_") and isinstance(value, keras.optimizers.Optimizer):
            found[name] = value
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        found["optimizer"] = optimizer
    return found


def note_optimizers(model: Any, path: Path) -> None:
    """Write into the saved file which of `model.weights` each built optimizer steps (by position), for
    `restore_optimizers` in a process where that optimizer is not built yet."""
    position = {id(w): i for i, w in enumerate(model.weights)}
    notes = {}
    for name, opt in optimizers_of(model).items():
        if opt.built:
            indices = [position.get(id(v)) for v in keras_compat.optimizer_variables(opt)]
            if indices and None not in indices:
                notes[name] = indices
    note(path, "optimizers", notes)


def note(path: Path, key: str, value: Any) -> None:
    """Keep `value` under `key` in the file's metadata (Keras ignores what it does not know there): the objects a
    model names (`objects`, kerasnames.py) and its optimizers' weights (`optimizers`) travel with the file."""
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as out:
        for info, data in entries:
            if info.filename == METADATA:
                meta = json.loads(data)
                meta.setdefault(NOTE_KEY, {})[key] = value
                data = json.dumps(meta).encode()
            out.writestr(info, data)


def saved_notes(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as z:
        if METADATA not in z.namelist():
            return {}
        meta = json.loads(z.read(METADATA))
    notes = meta.get(NOTE_KEY) if isinstance(meta, dict) else None
    return notes if isinstance(notes, dict) else {}


def restore_optimizers(model: Any, path: Path) -> list[str]:
    """Load every optimizer's state from the file into `model`'s optimizers of the same attribute, building one that
    is not built over the weights the file's notes name (`model.trainable_variables` for `optimizer` when it names
    none). Returns what could not be restored, in words (an optimizer whose variables differ)."""
    import h5py
    import numpy as np

    notes = saved_notes(path).get("optimizers") or {}
    problems = []
    with zipfile.ZipFile(path) as z, h5py.File(io.BytesIO(z.read(WEIGHTS)), "r") as h5:
        for name, opt in optimizers_of(model).items():
            group = h5.get(f"{name}/vars")
            if group is None or not len(group):
                continue
            values = [np.asarray(group[str(i)]) for i in range(len(group))]
            if not opt.built and len(values) != len(opt.variables):
                indices = notes.get(name)
                weights = model.weights
                if indices is not None and all(isinstance(i, int) and 0 <= i < len(weights) for i in indices):
                    opt.build([weights[i] for i in indices])
                elif name == "optimizer":
                    opt.build(model.trainable_variables)
                else:
                    problems.append(f"{name}: the file does not say which weights it steps")
                    continue
            if len(opt.variables) != len(values) or any(
                tuple(v.shape) != tuple(val.shape) for v, val in zip(opt.variables, values)
            ):
                problems.append(f"{name}: {len(values)} saved variables, {len(opt.variables)} here")
                continue
            for var, val in zip(opt.variables, values):
                var.assign(val)
    return problems
