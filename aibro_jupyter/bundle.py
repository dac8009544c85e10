"""Model and data → content-addressed files for upload; trained artifacts → the same model object, in place.

Every check here runs before anything is uploaded, and each error names the problem and the fix."""

from __future__ import annotations

import collections
import json
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core.compat import keras as keras_compat
from aibro_core.kerasfile import keras_notes_quiet, note, note_optimizers, restore_optimizers

from .blobsource import ArraySource, ByteSource, FileSource
from .cellcode import is_lambda
from .checks import check_branch
from .dataset_blob import check_dataset, is_dataset, save_dataset, travelling_pass
from .errors import ValidationError
from .kerasnames import NamePlan
from .randomstate import random_state_kept


@dataclass
class Bundle:
    """What to upload (a key → a source read in place) and the job-spec pieces that point at it. Arrays are never
    copied to disk; only the saved model and tf.data datasets are written, into `workdir`, removed after submit.

    A key is the source's SHA-256 when it was hashed here, or a placeholder (`pending-N`) for an array whose name
    comes from the upload itself (a known name from hashcache.py, or a one-pass upload of new data); `upload`
    puts the real names into `data` and `model_sha`."""

    workdir: Path
    sources: dict[str, ByteSource] = field(default_factory=dict)
    model_sha: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(src.size for src in self.sources.values())

    def add(self, source: ByteSource) -> str:
        if source.known_sha() is not None or source.maybe_new():
            same = getattr(source, "arr", None)
            for key, held in self.sources.items():  # the same array twice (x and validation x) is one upload
                if key.startswith(PENDING) and same is not None and getattr(held, "arr", None) is same:
                    return key
            key = f"{PENDING}{len(self.sources)}"
            self.sources[key] = source
            return key
        sha = source.sha256()
        source.remember(sha)
        self.sources.setdefault(sha, source)
        return sha

    def add_file(self, path: Path) -> str:
        return self.add(FileSource(path))

    def upload(self, client: Any) -> int:
        """Upload what the backend lacks and put every real name in place; returns the bytes sent."""
        names, sent = {}, 0
        for key, source in self.sources.items():
            sha, n = client.upload_source(source, None if key.startswith(PENDING) else key)
            names[key], sent = sha, sent + n
        self.data = _renamed(self.data, names)
        self.model_sha = names.get(self.model_sha, self.model_sha)
        return sent


PENDING = "pending-"


def with_stand_ins(data: Any) -> Any:
    """The data tree with each pending array named by a well-formed stand-in digest: its shape as the backend will
    see it once the upload has named them, for checking the spec before anything is sent."""
    return _renamed(data, collections.defaultdict(lambda: "0" * 64))


def _renamed(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _renamed(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, names) for v in value]
    if isinstance(value, str) and value.startswith(PENDING):
        return names[value]
    return value


# -- model -------------------------------------------------------------------------------------------
def check_model(model: Any, safe_mode: bool = True, compiled: bool = True) -> None:
    """Refuse what cannot train remotely, before anything else is looked at; what the model names by class or
    function is matched to the notebook later (kerasnames.plan_names). `compiled=False`: the model need not be
    compiled (a HyperModel's own fit trains it, with a loop of its own or a compile of its own)."""
    import keras

    if not isinstance(model, keras.Model):
        raise ValidationError(
            f"expected a Keras model (keras.Model), got {type(model).__module__}.{type(model).__name__}: "
            "pass the model object whose .fit you want to run remotely"
        )
    if compiled and (getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False)):
        raise ValidationError(
            f"model '{model.name}' is not compiled: call model.compile(optimizer=..., loss=..., metrics=...) first"
        )
    if not safe_mode:
        return
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.Lambda) and is_lambda(layer.function):
            raise ValidationError(
                f"layer '{layer.name}' is a Lambda layer over a lambda, which Keras saves as Python bytecode and loads "
                "only with safe_mode=False: opt out with safe_mode=False (`--unsafe` in %%cloud_fit) if you trust "
                "this code, or give it a named function (def ...: Keras saves that by name)"
            )
    compiled = keras_compat.compile_config(model)
    for key in ("loss", "metrics", "weighted_metrics"):
        if any(is_lambda(f) for f in _flatten(compiled.get(key))):
            raise ValidationError(
                f"compile()'s {key} holds a lambda, which Keras saves as Python bytecode and loads only with "
                "safe_mode=False: opt out with safe_mode=False (`--unsafe` in %%cloud_fit) if you trust this code, "
                "or give it a named function (def ...: Keras saves that by name)"
            )


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def all_layers(model: Any) -> list[Any]:
    return keras_compat.nested_layers(model)


def build_from_data(model: Any, x: Any) -> None:
    """A subclassed model that was compiled but never called has no weights to save or to copy back: call it
    once on one sample of the training inputs, as fit would, so the worker and the kernel share its variables."""
    if model.built and (model.weights or not all_layers(model)):
        return
    if not _calls(model):
        return  # no call() of its own (a GAN driven by train_step): fit trains it as it is, so does the worker
    sample = _first_sample(x)
    if sample is None:
        raise ValidationError(
            f"model '{model.name}' is not built and its input shape cannot be read from the data: call "
            "model.build(input_shape) or run it once on a batch (model(x[:1])) before training remotely"
        )
    try:
        model(sample)
    except Exception as exc:  # noqa: BLE001 - the user's own call(); say what happened and how to fix it
        raise ValidationError(
            f"model '{model.name}' is not built, and calling it on one sample of x failed ({type(exc).__name__}: "
            f"{exc}): check that x matches what call() expects, or build it yourself first"
        ) from None


def _calls(model: Any) -> bool:
    import keras

    return type(model).call is not keras.Model.call


def _first_sample(x: Any) -> Any:
    if is_dataset(x):
        batch = next(iter(x.take(1)), None)
        return None if batch is None else batch[0]
    if isinstance(x, dict):
        return {k: _first_sample(val) for k, val in x.items()}
    if isinstance(x, (list, tuple)):
        return [_first_sample(val) for val in x]
    if hasattr(x, "shape") and len(x.shape) and x.shape[0]:
        return x[:1]
    return None


def save_model(model: Any, bundle: Bundle, names: NamePlan, safe_mode: bool = True) -> str:
    path = bundle.workdir / "model.keras"
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built and model.built and model.trainable_variables:
        optimizer.build(model.trainable_variables)  # so the worker loads every optimizer variable, silently
    with names.saved_as(), keras_notes_quiet():
        model.save(path)
    note_optimizers(model, path)
    note(path, "objects", names.refs)
    canonicalize_keras(path)
    check_reloads(model, path, names.local, safe_mode)
    bundle.model_sha = bundle.add_file(path)
    return bundle.model_sha


def check_reloads(model: Any, path: Path, custom_objects: dict[str, Any], safe_mode: bool = True) -> None:
    """Load the saved model back here, as the worker will (`keras.saving.load_model` with the objects the model
    names), so that a model Keras cannot rebuild (a custom layer whose __init__ refuses its own get_config) fails in
    the cell, before any upload, with Keras' own reason first; and the weights it loads must be the ones saved."""
    import keras

    with keras_notes_quiet(), random_state_kept():
        try:
            loaded = keras.saving.load_model(path, custom_objects=custom_objects, safe_mode=safe_mode)
        except Exception as exc:  # noqa: BLE001 - whatever Keras raises, the user needs its reason
            raise ValidationError(_reload_failure(exc, model)) from None
    saved, back = model.weights, loaded.weights
    differ = len(saved) != len(back) or any(
        tuple(a.shape) != tuple(b.shape) or not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(saved, back)
    )
    del loaded
    if differ:
        raise ValidationError(
            f"model '{model.name}' does not load back with its weights (saved {len(saved)} variables, Keras loads "
            f"{len(back)} or other values), so the worker would train other weights than yours: give each custom "
            "layer a build() that creates its weights, and a get_config() with every constructor argument"
        )


def _reload_failure(exc: BaseException, model: Any) -> str:
    """Keras wraps the reason a layer cannot be rebuilt in several layers of 'could not be deserialized' text with
    whole configs; the innermost 'Exception encountered:' is the reason. That first, then the fix."""
    reason = str(exc).split("Exception encountered:")[-1].strip() or type(exc).__name__
    reason = reason.splitlines()[0] if len(reason) > 600 else reason
    fix = "fix the class Keras names so that from_config(get_config()) rebuilds it"
    if "Could not locate" in reason:
        fix = "register what Keras names: @keras.saving.register_keras_serializable(package='...') on its def/class"
    elif "unexpected keyword argument" in reason:
        fix = (
            "let the custom class's __init__ take **kwargs and pass them on (super().__init__(**kwargs)): Keras "
            "rebuilds it from get_config(), which holds name, trainable and dtype too"
        )
    return (
        f"{reason} (Keras cannot load model '{model.name}' back from its saved form, and the worker loads it that "
        f"way): {fix}"
    )


def canonicalize_keras(path: Path) -> None:
    """Drop the save time from a .keras file so an unchanged model has the same digest and uploads once."""
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as out:
        for info, data in entries:
            if info.filename == "metadata.json":
                meta = json.loads(data)
                meta.pop("date_saved", None)
                data = json.dumps(meta).encode()
            fixed = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            fixed.compress_type = info.compress_type
            fixed.external_attr = info.external_attr
            out.writestr(fixed, data)


# -- data --------------------------------------------------------------------------------------------
def as_array(value: Any, name: str) -> np.ndarray:
    """A numpy array that can travel as .npy without pickle: numbers as they are, text as a unicode array."""
    if is_dataset(value):
        raise ValidationError(
            f"{name} is a tf.data.Dataset, which can only be x or validation_data: "
            "make one dataset yield (inputs, targets) and pass it as x"
        )
    if _is_string_tensor(value):
        value = value.numpy()
    try:
        arr = np.asarray(value)
    except Exception as exc:  # noqa: BLE001
        raise ValidationError(
            f"{name} cannot be turned into a numpy array: {exc}. Pass a rectangular numeric array: pad ragged "
            "sequences to one length (keras.utils.pad_sequences) and convert with np.asarray(value, dtype='float32')"
        ) from None
    if arr.dtype == object:
        arr = _text_array(arr, name)
    if arr.dtype.kind == "S":
        arr = _decode_bytes(arr, name)
    if arr.dtype.kind not in "biufcUM?":
        raise ValidationError(f"{name} has unsupported dtype {arr.dtype}: use a numeric dtype, or strings")
    if arr.ndim == 0:
        raise ValidationError(f"{name} is a scalar: pass an array with one row per sample")
    return arr


def _is_string_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("tensorflow") and getattr(getattr(value, "dtype", None), "name", "") in (
        "string",
    )


def _text_array(arr: np.ndarray, name: str) -> np.ndarray:
    """An object array of Python strings (what a TextVectorization model trains on) → a unicode array."""
    flat = arr.reshape(-1)
    if flat.size and all(isinstance(v, bytes) for v in flat):
        return _decode_bytes(arr.astype("S"), name)
    bad = next((v for v in flat if not isinstance(v, str)), None)
    if flat.size and bad is None:
        return arr.astype(str)
    raise ValidationError(
        f"{name} has dtype=object holding {type(bad).__name__} values (ragged lists or mixed Python objects), which "
        "cannot travel without pickle: convert it to a numeric array (np.asarray(value, dtype='float32'), padding "
        "ragged sequences with keras.utils.pad_sequences), or to strings"
    )


def _decode_bytes(arr: np.ndarray, name: str) -> np.ndarray:
    try:
        return np.char.decode(arr, "utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"{name} holds bytes that are not UTF-8 text ({exc}): decode them to str first") from None


def encode_tree(value: Any, name: str, bundle: Bundle, depth: int = 1) -> tuple[dict[str, Any] | None, int | None]:
    """Arrays (or lists/dicts of arrays) → data tree of blobs; returns (tree, number of samples)."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        check_branch(value, name, depth)
        items = {str(k): encode_tree(val, f"{name}[{k!r}]", bundle, depth + 1) for k, val in value.items()}
        return {"dict": {k: t for k, (t, _) in items.items()}}, _same_len(name, [n for _, n in items.values()])
    if isinstance(value, (list, tuple)) and value and all(hasattr(v, "shape") for v in value):
        check_branch(value, name, depth)
        items_l = [encode_tree(val, f"{name}[{i}]", bundle, depth + 1) for i, val in enumerate(value)]
        return {"list": [t for t, _ in items_l]}, _same_len(name, [n for _, n in items_l])
    arr = as_array(value, name)
    sha = bundle.add(ArraySource(arr, name))
    return {"blob": sha, "shape": list(arr.shape), "dtype": str(arr.dtype)}, int(arr.shape[0])


def _same_len(name: str, lengths: list[int | None]) -> int | None:
    known = {n for n in lengths if n is not None}
    if len(known) > 1:
        raise ValidationError(f"the arrays in {name} have different numbers of samples: {sorted(known)}")
    return known.pop() if known else None


def encode_data(
    bundle: Bundle,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    validation_data: Any = None,
    model: Any = None,
    steps: tuple[int | None, int | None] = (None, None),
    epochs: int = 1,
    shuffle_batches: bool = False,
) -> dict[str, Any]:
    """The job spec's `data`: numpy trees, or tf.data datasets that yield (inputs, targets[, weights]). `steps` is
    (steps_per_epoch, validation_steps) and `epochs` the epochs left to train: they bound an endless dataset.
    `shuffle_batches`: x's batches come in a new order each epoch (a PyDataset's, as fit shuffles it)."""
    if x is None:
        raise ValidationError("train_X is None: pass the training inputs")
    if is_dataset(x):
        for label, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValidationError(
                    f"x is a tf.data.Dataset, so {label} must come from the dataset, not be passed beside it: "
                    "make the dataset yield (inputs, targets) or (inputs, targets, sample_weights)"
                )
        train = _dataset_part(x, "x", bundle, model, steps[0], epochs)
        if shuffle_batches:
            train["x"]["shuffle_batches"] = True
    else:
        train = _array_part(x, y, sample_weight, bundle)
    bundle.data = {**train, "validation": _validation_part(validation_data, bundle, model, steps[1], epochs)}
    return bundle.data


def _array_part(x: Any, y: Any, sample_weight: Any, bundle: Bundle) -> dict[str, Any]:
    tx, nx = encode_tree(x, "x", bundle)
    ty, ny = encode_tree(y, "y", bundle)
    tw, nw = encode_tree(sample_weight, "sample_weight", bundle)
    for label, n in (("y", ny), ("sample_weight", nw)):
        if n is not None and nx is not None and n != nx:
            raise ValidationError(
                f"x has {nx} samples but {label} has {n}: they must have the same length (one row per sample)"
            )
    return {"x": tx, "y": ty, "sample_weight": tw}


def _validation_part(
    validation_data: Any, bundle: Bundle, model: Any, steps: int | None, epochs: int
) -> dict[str, Any] | None:
    if validation_data is None:
        return None
    if is_dataset(validation_data):
        return _dataset_part(validation_data, "validation_data", bundle, model, steps, epochs)
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValidationError(
            "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, sample_weight), or a tf.data.Dataset"
        )
    parts = list(validation_data) + [None] * (3 - len(validation_data))
    vx, nvx = encode_tree(parts[0], "x_val", bundle)
    vy, nvy = encode_tree(parts[1], "y_val", bundle)
    vw, _ = encode_tree(parts[2], "w_val", bundle)
    if nvx is not None and nvy is not None and nvx != nvy:
        raise ValidationError(f"validation x has {nvx} samples but validation y has {nvy}: they must match")
    return {"x": vx, "y": vy, "sample_weight": vw}


def _dataset_part(ds: Any, name: str, bundle: Bundle, model: Any, steps: int | None, epochs: int) -> dict[str, Any]:
    check_dataset(ds, name, model, steps)
    one_pass, repeat = travelling_pass(ds, steps, epochs)
    path = save_dataset(one_pass, bundle.workdir / f"{name}-{len(bundle.sources)}.tar")
    node: dict[str, Any] = {"dataset": bundle.add_file(path)}
    if repeat:
        node["repeat"] = True
    return {"x": node, "y": None, "sample_weight": None}


def new_bundle() -> Bundle:
    """A bundle whose work directory (for the saved model and datasets) is removed by its caller afterwards."""
    return Bundle(Path(tempfile.mkdtemp(prefix="aibro-bundle-")))


# -- back into the kernel ------------------------------------------------------------------------------
def load_into(model: Any, path: Path, custom_objects: dict[str, Any], safe_mode: bool = True) -> Any:
    """Copy trained weights and every optimizer's state from a .keras file into `model`, in place."""
    import keras

    with keras_notes_quiet(), random_state_kept():
        trained = keras.saving.load_model(path, custom_objects=custom_objects, safe_mode=safe_mode)
    _build_like(model, trained)
    model.set_weights(trained.get_weights())
    for problem in restore_optimizers(model, path):
        warnings.warn(f"optimizer state not copied back ({problem}); the weights were", stacklevel=2)
    return model


def _build_like(model: Any, trained: Any) -> None:
    """A layer the kernel never built (a sub-model called first inside the remote fit) gets the trained one's shape,
    so it holds the trained weights too."""
    for mine, theirs in zip(all_layers(model), all_layers(trained)):
        if not mine.built and theirs.built and type(mine).__name__ == type(theirs).__name__:
            config = theirs.get_build_config()
            if config:
                mine.build_from_config(config)
