"""What Keras records by name in a model, found in the notebook so the worker finds each again, and the models it
cannot describe at all, made describable.

Keras saves a custom layer, loss, metric or activation as the name of its class or function; its own loader finds
only what was registered (`register_keras_serializable`). A notebook's fit needs no registration, so neither does a
remote one: every name the saved model holds is matched here to the one object of that name the model uses (or the
notebook defines), and travels as a reference the worker resolves (worker/objects.py) and hands to each Keras load as
`custom_objects`; a closure travels as its enclosing function and the values it closes over (argcodec.py).

A model or layer whose `__init__` takes other models or layers and has no `get_config` (a VAE of an encoder and a
decoder, a distiller, a GAN) cannot be saved by Keras at all. Its constructor arguments are read back from the object
(an attribute of the same name, or the one `__init__` assigns it to), and it is saved as
`aibro_core.kerasfile.rebuildable` of its class: sub-models as their own Keras configs, weights and optimizers as
Keras saves them."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
import types
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aibro_core.compat import keras as keras_compat
from aibro_core.kerasfile import init_of, rebuildable, saved_as, user_objects

from .argcodec import check_importable, function_ref, is_closure, is_keras_object, module_of, name_in_module
from .cellcode import MAIN_MODULE, is_cell_object, is_lambda, travel_name
from .errors import ValidationError
from .randomstate import random_state_kept
from .rebuildplan import assigned_attributes

KERAS_MODULES = ("keras", "tensorflow", "tf_keras")


@dataclass
class NamePlan:
    """`refs` go into the job spec (name → reference); `travel` are the classes and functions whose code travels;
    `local` are the kernel's own custom objects for its loads; `swaps` the composite objects and the class each is
    saved as."""

    refs: dict[str, dict[str, Any]] = field(default_factory=dict)
    travel: list[Any] = field(default_factory=list)
    local: dict[str, Any] = field(default_factory=dict)
    swaps: list[tuple[Any, type]] = field(default_factory=list)
    lambdas: list[tuple[Any, str, Any]] = field(default_factory=list)  # (holder, key, the value with named lambdas)

    @contextlib.contextmanager
    def saved_as(self) -> Iterator[None]:
        """The block in which the model's composites save as their rebuildable classes, and its lambdas (a Lambda
        layer's, compile()'s losses and metrics) as functions of a name (so Keras records that name, not the lambda's
        bytecode)."""
        kept = [(holder, key, _get(holder, key)) for holder, key, _ in self.lambdas]
        try:
            for holder, key, named in self.lambdas:
                _set(holder, key, named)
            with saved_as(self.swaps):
                yield
        finally:
            for holder, key, value in kept:
                _set(holder, key, value)


def _get(holder: Any, key: str) -> Any:
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _set(holder: Any, key: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


def plan_names(
    model: Any, namespace: dict[str, Any] | None = None, extra: list[tuple[str, Any]] | None = None
) -> NamePlan:
    """Every class and function the saved model (and `extra` Keras configs: a callback's or compile()'s arguments)
    names, matched to the notebook's objects; refused, named, where Keras names something no one can find again."""
    import keras

    plan = NamePlan()
    for obj, cls, (init, config_args) in composites(model):
        plan.swaps.append((obj, rebuildable(cls, init, config_args)))
    ns = namespace if namespace is not None else vars(sys.modules["__main__"])
    _name_lambdas(model, plan, ns)
    with plan.saved_as():
        try:
            config = keras.saving.serialize_keras_object(model)
        except Exception as exc:  # noqa: BLE001 - Keras' own reason, with the piece that needs a fix
            raise ValidationError(
                f"Keras cannot describe model '{model.name}' to save it ({type(exc).__name__}: {exc}): give the class "
                "Keras names a get_config() that returns its constructor arguments"
            ) from None
    composite_init = {type(obj): cls for obj, cls in plan.swaps}
    live = _live_objects(model)
    for name in [n for n, obj in plan.local.items() if is_lambda(obj)]:
        live[name].append(plan.local[name])
    for where, node in _config_nodes([("model", config), *(extra or [])]):
        recorded = _recorded(node)
        if recorded is None:
            continue
        kind, name = recorded
        obj = _find(kind, name, live, ns, where)
        if obj is None:
            continue
        _add(plan, name, obj, composite_init, where, ns)
    return plan


def _name_lambdas(model: Any, plan: NamePlan, ns: dict[str, Any]) -> None:
    """A lambda written in a cell (or inside a function) that Keras would save as bytecode (a Lambda layer's, a loss
    or metric given to compile()) travels as its source instead, under the name of the variable holding it (or one
    made from its text): Keras' bytecode would run on the worker with Keras' globals, not the notebook's (`tf`,
    `ops`...). It still needs --unsafe, as Keras' own load of a lambda does (bundle.check_model)."""
    import keras

    for layer in _layers(model):
        if isinstance(layer, keras.layers.Lambda):
            named = _named(getattr(layer, "function", None), f"Lambda layer '{layer.name}'", plan, ns)
            if named is not None:
                plan.lambdas.append((layer, "function", named))
    compiled = keras_compat.compile_config(model)
    if compiled:
        for key in ("loss", "metrics", "weighted_metrics"):
            value = compiled.get(key)
            renamed = _renamed(value, f"compile()'s {key}", plan, ns)
            if renamed is not value:
                plan.lambdas.append((compiled, key, renamed))


def _renamed(value: Any, where: str, plan: NamePlan, ns: dict[str, Any]) -> Any:
    """`value` (a function, or lists and dicts of them) with its travelling lambdas named; itself if it has none."""
    if isinstance(value, (list, tuple)):
        items = [_renamed(v, where, plan, ns) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    if isinstance(value, dict):
        items_d = {k: _renamed(v, where, plan, ns) for k, v in value.items()}
        return items_d if any(items_d[k] is not value[k] for k in value) else value
    named = _named(value, where, plan, ns)
    return value if named is None else named


def _named(function: Any, where: str, plan: NamePlan, ns: dict[str, Any]) -> Any:
    """A copy of a travelling lambda under its travel name (its source travels, found by that name), else None."""
    if not is_lambda(function) or not (is_cell_object(function) or is_closure(function)):
        return None  # not a lambda, or one of an installed module: Keras' own bytecode
    if str(function.__module__).split(".")[0] in KERAS_MODULES:
        return None  # made again by Keras from a saved model's bytecode (no source left): it travels as bytecode again
    ref = function_ref(function, where, plan.travel, ns)
    if "__closure__" in ref:
        name = _closure_lambda_name(function, ref["__closure__"])
        plan.refs[name] = {"closure": ref["__closure__"]}
    else:
        name = travel_name(function, ns)
        plan.refs[name] = {"ref": ref["__function__"]}
    plan.local[name] = function
    return types.FunctionType(
        function.__code__, function.__globals__, name, function.__defaults__, function.__closure__
    )


def _closure_lambda_name(function: Any, ref: dict[str, Any]) -> str:
    """A name for a lambda made inside a function, the same in every run (so the saved model is the same bytes)."""
    where = f"{function.__module__}:{function.__qualname__}:{function.__code__.co_firstlineno}:{ref.get('nth', 0)}"
    return f"_lambda_{hashlib.sha256(where.encode()).hexdigest()[:10]}"


def _recorded(node: dict[str, Any]) -> tuple[str, str] | None:
    """('class' | 'function', the name Keras looks it up by) for a node that is not Keras' own, else None."""
    module = str(node.get("module") or "")
    class_name = node.get("class_name")
    if module.split(".")[0] in KERAS_MODULES or not isinstance(class_name, str) or class_name.startswith("__"):
        return None  # Keras' own, or one of its marked values (a lambda's bytecode, a tuple, an array...)
    if class_name == "function":
        name = node.get("config")
        return ("function", name) if isinstance(name, str) else None
    name = node.get("registered_name") or class_name
    return ("class", name) if isinstance(name, str) else None


def _find(kind: str, name: str, live: dict[str, list[Any]], ns: dict[str, Any], where: str) -> Any:
    import keras

    registered = keras.saving.get_registered_object(name)
    if registered is not None:
        return registered
    candidates = list({id(o): o for o in live.get(name, [])}.values())
    if not candidates:
        held = ns.get(name)
        if isinstance(held, (type, types.FunctionType)) and getattr(held, "__name__", None) == name:
            candidates = [held]
    if kind == "function" and not candidates and _keras_function(name):
        return None  # a Keras activation or loss given by the same name from elsewhere (tf.nn.relu): Keras finds it
    if not candidates:
        raise ValidationError(
            f"{where} is the {kind} {name}, which Keras saves by name only, and no {kind} of that name is in the "
            f"model or the notebook: define {name} at the top level of a cell or of a module next to the notebook"
        )
    if len(candidates) > 1:
        places = ", ".join(f"{o.__module__}.{o.__qualname__}" for o in candidates)
        raise ValidationError(
            f"the model uses two different {kind}s named {name} ({places}), and Keras saves only the name: rename "
            "one of them"
        )
    return candidates[0]


def _keras_function(name: str) -> bool:
    """Whether Keras finds a function of this name itself (an activation, a loss), as its loader would."""
    import keras

    for finder in (keras.activations.get, keras.losses.get, keras.metrics.get):
        try:
            if finder(name) is not None:
                return True
        except (ValueError, TypeError):
            continue
    return False


def _add(plan: NamePlan, name: str, obj: Any, composite_init: dict[type, type], where: str, ns: dict[str, Any]) -> None:
    if name in plan.refs:
        return
    if isinstance(obj, type):
        module = str(obj.__module__)
        if module.split(".")[0] in KERAS_MODULES:
            return
        check_importable(obj, where)
        plan.travel.append(obj)
        ref: dict[str, Any] = {"ref": f"{module_of(obj)}:{name_in_module(obj, ns)}"}
        rebuilt = composite_init.get(obj)
        if rebuilt is not None:
            init, config_args = init_of(rebuilt) or ({}, ())
            ref["init"] = init
            if config_args:
                ref["config_args"] = list(config_args)
            plan.local[name] = rebuilt
        else:
            plan.local[name] = obj
        plan.refs[name] = ref
        return
    travelled = function_ref(obj, where, plan.travel, ns)
    plan.refs[name] = (
        {"closure": travelled["__closure__"]} if "__closure__" in travelled else {"ref": travelled["__function__"]}
    )
    plan.local[name] = obj


# -- models made of models ---------------------------------------------------------------------------------


def composites(model: Any) -> list[tuple[Any, type, tuple[dict[str, str], tuple[str, ...]]]]:
    """The user's objects in the model (itself, its layers, its losses, metrics and optimizer) that Keras cannot
    describe (their get_config raises NotImplementedError: an __init__ given other models or layers) or describes
    wrongly (from_config(get_config()) fails, as a get_config that adds name and dtype for an __init__ without
    **kwargs does, or makes an object whose constructor arguments differ: a custom loss whose get_config forgot one),
    each with its class and where each constructor argument is read back from. Every object of such a class is saved
    that way, since Keras finds the class by name. One Keras cannot rebuild and whose arguments are kept nowhere is
    left to Keras' own load, whose reason the cell then shows."""
    objects = user_objects(model)
    live = {name: objs[0] for name, objs in _live_objects(model).items()}
    classes: dict[type, tuple[dict[str, str], tuple[str, ...]]] = {}
    for obj in objects:
        cls = type(obj)
        if cls in classes:
            continue
        try:
            config = obj.get_config()
        except NotImplementedError:
            classes[cls] = _argument_sources(obj, cls, None, live)
            continue
        if not _rebuilds_the_same(obj, config, live):
            try:
                classes[cls] = _argument_sources(obj, cls, config, live)
            except ValidationError:
                continue
    return [(obj, type(obj), classes[type(obj)]) for obj in objects if type(obj) in classes]


def _rebuilds_the_same(obj: Any, config: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether Keras' own from_config makes the object again from this config, with the constructor arguments it
    holds (the kernel's random state kept)."""
    import keras

    cls = type(obj)
    with random_state_kept(), keras.saving.custom_object_scope(live):
        try:
            again = cls.from_config(config)
        except Exception:  # noqa: BLE001 - any failure means the worker could not rebuild it this way either
            return False
    assigned = assigned_attributes(cls.__init__)
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        attribute = assigned.get(param.name, param.name)
        mine, theirs = _value(obj, attribute), _value(again, attribute)
        if mine is not _MISSING and theirs is not _MISSING and not _equal(mine, theirs):
            return False
    return True


_MISSING = object()


def _value(obj: Any, attribute: str) -> Any:
    try:
        value = getattr(obj, attribute)
    except Exception:  # noqa: BLE001 - a property that fails holds nothing to compare
        return _MISSING
    return _MISSING if inspect.ismethod(value) else value


def _equal(a: Any, b: Any) -> bool:
    """Equal as constructor arguments: plain values by value, arrays by content, Keras objects by config; anything
    else is not compared (taken as equal)."""
    plain = (type(None), bool, int, float, str)
    if isinstance(a, plain) and isinstance(b, plain):
        return bool(a == b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if hasattr(a, "shape") and hasattr(b, "shape") and not is_keras_object(a):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - not comparable as arrays
            return True
    if is_keras_object(a) and type(a) is type(b) and not _is_layer(a):
        try:
            return bool(a.get_config() == b.get_config())
        except Exception:  # noqa: BLE001 - no config to compare
            return True
    return True


def _argument_sources(
    obj: Any, cls: type, config: dict[str, Any] | None, live: dict[str, Any]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Where each named argument of `cls.__init__` is read back from: the attribute `__init__` assigns it to
    (`self.encoder = encoder`), else one of the same name, else the class's own `config` (Keras' automatic config of
    plain arguments). An argument found nowhere is refused, unless it has a default (the default is used). A
    `**kwargs` passes the object's name on, where the class then still rebuilds."""
    init = cls.__init__
    params = list(inspect.signature(init).parameters.values())[1:]
    assigned = assigned_attributes(init)
    kept: dict[str, str] = {}
    from_config: list[str] = []
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            continue
        if param.kind is param.VAR_POSITIONAL:
            raise ValidationError(
                f"{cls.__name__}.__init__ takes *{param.name}, which the worker cannot pass again: take a list instead "
                f"({param.name}=[...]) and keep it as self.{param.name}"
            )
        attribute = assigned.get(param.name) or (param.name if _holds_value(obj, param.name) else None)
        if attribute is not None:
            kept[param.name] = attribute
        elif config is not None and param.name in config:
            from_config.append(param.name)
        elif param.default is param.empty:
            raise ValidationError(
                f"{cls.__name__} takes the argument '{param.name}' in __init__ but keeps it nowhere the worker can "
                f"read it back, so the model cannot be rebuilt remotely: keep it (self.{param.name} = "
                f"{param.name}), or give {cls.__name__} a get_config() that returns its arguments"
            )
    if any(p.kind is p.VAR_KEYWORD for p in params) and _rebuilds_with(obj, cls, {**kept, "name": "name"}, live):
        kept["name"] = "name"
    return kept, tuple(from_config)


def _rebuilds_with(obj: Any, cls: type, init: dict[str, str], live: dict[str, Any]) -> bool:
    """Whether the class takes these arguments again (a **kwargs that is given its own name= already fails)."""
    import keras

    made = rebuildable(cls, init)
    with random_state_kept(), keras.saving.custom_object_scope(live):
        try:
            made.from_config(made.get_config(obj))
        except Exception:  # noqa: BLE001 - without them, then
            return False
    return True


def _holds_value(obj: Any, name: str) -> bool:
    try:
        value = getattr(obj, name)
    except Exception:  # noqa: BLE001 - a property that fails is no kept argument
        return False
    return not (inspect.ismethod(value) and value.__self__ is obj)


# -- where the names come from -----------------------------------------------------------------------------
def _layers(model: Any) -> list[Any]:
    return keras_compat.nested_layers(model)


def _live_objects(model: Any) -> dict[str, list[Any]]:
    """Classes and functions the model holds, by name: its layers' classes and whatever their attributes hold
    (activations, a Lambda's function, initializers...), and compile()'s losses, metrics and optimizer."""
    found: dict[str, list[Any]] = defaultdict(list)
    seen: set[int] = set()

    def scan(value: Any, depth: int) -> None:
        if depth > 4 or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, (type, types.FunctionType)):
            found[value.__name__].append(value)
        elif isinstance(value, (list, tuple)):
            for item in value[:1000]:
                scan(item, depth + 1)
        elif isinstance(value, dict):
            for item in list(value.values())[:1000]:
                scan(item, depth + 1)
        elif is_keras_object(value):
            found[type(value).__name__].append(type(value))
            if not _is_layer(value):
                for item in vars(value).values():
                    scan(item, depth + 1)

    for layer in [model, *_layers(model)]:
        found[type(layer).__name__].append(type(layer))
        for item in vars(layer).values():
            if not _is_layer(item):
                scan(item, 1)
    scan(dict(keras_compat.compile_config(model)), 0)
    return found


def _is_layer(value: Any) -> bool:
    import keras

    return isinstance(value, keras.layers.Layer)


def _config_nodes(configs: list[tuple[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every serialized object in Keras configs, with words for where it sits (the layer and argument)."""
    out: list[tuple[str, dict[str, Any]]] = []

    def walk(config: Any, where: str) -> None:
        if isinstance(config, list):
            for item in config:
                walk(item, where)
        elif isinstance(config, dict):
            inner = config.get("config")
            owner = where
            if "class_name" in config and isinstance(inner, dict) and isinstance(inner.get("name"), str):
                owner = f"{config['class_name']} '{inner['name']}'"
            if "class_name" in config:
                out.append((where, config))
            for key, value in config.items():
                if isinstance(value, (dict, list)):
                    child = owner if key in ("config", "layers", "compile_config") else f"{owner} argument '{key}'"
                    walk(value, child)

    for where, config in configs:
        walk(config, where)
    return out


def keras_configs(callbacks: list[dict[str, Any]], compile_args: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The Keras configs inside a job's encoded callback and compile() arguments (`{"__keras__": config}`): the
    worker deserializes them too, so what they name is matched like the model's own."""
    found: list[tuple[str, Any]] = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            if "__keras__" in value:
                found.append((where, value["__keras__"]))
                return
            for key, item in value.items():
                walk(item, f"{where} argument '{key}'")
        elif isinstance(value, list):
            for item in value:
                walk(item, where)

    for spec in callbacks:
        walk(spec.get("config") or {}, f"callback {spec.get('class')}")
    walk(compile_args or {}, "compile()")
    return found


def attached_objects(path: Any) -> dict[str, Any]:
    """The custom objects to load a trained model's file in a kernel that has no model object for it (attaching to
    a job later): what the file says the model names, found in this notebook's own definitions."""
    from aibro_core.kerasfile import saved_notes
    from aibro_core.objectrefs import resolve

    refs = saved_notes(path).get("objects") or {}
    try:
        return resolve(refs, {MAIN_MODULE: "__main__"})
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise ValidationError(
            f"the trained model names {', '.join(sorted(refs))}, defined with the notebook that submitted it, and "
            f"this kernel does not have them ({exc}): run the cells that define them (and the model) first, then "
            "load the result into that model object"
        ) from None
