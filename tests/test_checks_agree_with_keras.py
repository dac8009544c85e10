"""The kernel checks agree with Keras (issue 23 item 2): every input/model combination below goes through the local
`model.fit` and through everything a remote fit does before its upload (`Training.prepare`: the checks, the
data encoding, the saved model loaded back). A check may refuse only what the local fit refuses too, and a
combination the local fit refuses must be refused in the kernel, not found on the worker after an upload.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from aibro_backend.api.base import ApiError
from aibro_backend.api.jobspec import validate_spec
from aibro_backend.worker.datatree import fit_data
from aibro_core.errors import ValidationError
from aibro_core.models import Data, JobSpec
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient, spec_json
from aibro_jupyter.fitrequest import FitRequest

N = 96
rng = np.random.default_rng(7)
X = rng.normal(size=(N, 8)).astype("float32")
Y = rng.integers(0, 3, size=(N,)).astype("int32")
W = rng.uniform(0.5, 1.5, size=(N,)).astype("float32")
TEXT = np.array([f"word{i % 7} other{i % 3} thing" for i in range(N)], dtype=object)  # as pandas gives text


def dense() -> keras.Model:
    inp = keras.Input((8,), name="features")
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(8)(inp)))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def sequential() -> keras.Model:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def two_inputs() -> keras.Model:
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, out)
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def two_inputs_list() -> keras.Model:
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], out)
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def two_outputs() -> keras.Model:
    inp = keras.Input((8,))
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(inp)
    reg = keras.layers.Dense(1, name="reg")(inp)
    model = keras.Model(inp, {"cls": cls, "reg": reg})
    model.compile("adam", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"})
    return model


def text_model(shape: tuple[int, ...] = (1,)) -> keras.Model:
    vec = keras.layers.TextVectorization(max_tokens=50, output_sequence_length=4)
    vec.adapt(TEXT)
    inp = keras.Input(shape=shape, dtype="string")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(vec(inp)))
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(h))
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def ds(*parts: Any, batch: int | None = 16) -> tf.data.Dataset:
    d = tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
    return d.batch(batch) if batch else d


@dataclass
class Case:
    name: str
    model: Callable[[], keras.Model]
    fit: Callable[[], dict[str, Any]]
    notes: list[str] = field(default_factory=list)


CASES = [
    Case("arrays", dense, lambda: {"x": X, "y": Y, "batch_size": 16}),
    Case("arrays float64 labels", dense, lambda: {"x": X.astype("float64"), "y": Y.astype("float64")}),
    Case("python lists", dense, lambda: {"x": X.tolist(), "y": Y.tolist()}),
    Case("python list labels", dense, lambda: {"x": X, "y": Y.tolist()}),
    Case("x and y lengths differ", dense, lambda: {"x": X, "y": Y[:-5]}),
    Case("wrong feature count", dense, lambda: {"x": X[:, :6], "y": Y}),
    Case("labels out of range", dense, lambda: {"x": X, "y": Y + 3}),
    Case("one-hot labels for a sparse loss", dense, lambda: {"x": X, "y": keras.utils.to_categorical(Y, 3)}),
    Case("labels with a trailing axis", dense, lambda: {"x": X, "y": Y[:, None]}),
    Case("NaN labels", dense, lambda: {"x": X, "y": np.where(np.arange(N) == 3, np.nan, Y)}),
    Case("NaN in features", dense, lambda: {"x": np.where(np.arange(8) == 2, np.nan, X), "y": Y}),
    Case("sample_weight", dense, lambda: {"x": X, "y": Y, "sample_weight": W}),
    Case("sample_weight with NaN", dense, lambda: {"x": X, "y": Y, "sample_weight": np.where(W > 1.4, np.nan, W)}),
    Case("class_weight", dense, lambda: {"x": X, "y": Y, "class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}),
    Case("validation_data pair", dense, lambda: {"x": X, "y": Y, "validation_data": (X[:20], Y[:20])}),
    Case("validation_data as a list", dense, lambda: {"x": X, "y": Y, "validation_data": [X[:20], Y[:20]]}),
    Case("validation_data triple", dense, lambda: {"x": X, "y": Y, "validation_data": (X[:20], Y[:20], W[:20])}),
    Case("validation_data dataset", dense, lambda: {"x": X, "y": Y, "validation_data": ds(X[:20], Y[:20])}),
    Case("validation_data with targets None", dense, lambda: {"x": X, "y": Y, "validation_data": (X[:20], None)}),
    Case("validation_split", dense, lambda: {"x": X, "y": Y, "validation_split": 0.25}),
    Case("dict x for named inputs", two_inputs, lambda: {"x": {"a": X[:, :5], "b": X[:, 5:]}, "y": Y}),
    Case("dict x with a wrong key", two_inputs, lambda: {"x": {"a": X[:, :5], "c": X[:, 5:]}, "y": Y}),
    Case("list x for two inputs", two_inputs_list, lambda: {"x": [X[:, :5], X[:, 5:]], "y": Y}),
    Case("one array for two inputs", two_inputs_list, lambda: {"x": X, "y": Y}),
    Case("dict x for a Sequential", sequential, lambda: {"x": {"features": X}, "y": Y}),
    Case("dict y for two outputs", two_outputs, lambda: {"x": X, "y": {"cls": Y, "reg": W}}),
    Case("string array (n,) for Input((1,))", text_model, lambda: {"x": TEXT, "y": Y}),
    Case("string array (n, 1) for Input((1,))", text_model, lambda: {"x": TEXT[:, None], "y": Y}),
    Case("string array for Input(())", lambda: text_model(()), lambda: {"x": TEXT, "y": Y}),
    Case("dataset", dense, lambda: {"x": ds(X, Y)}),
    Case("dataset with weights", dense, lambda: {"x": ds(X, Y, W)}),
    Case("dataset, drop_remainder", dense, lambda: {"x": tf.data.Dataset.from_tensor_slices((X, Y)).batch(16, True)}),
    Case("dataset of dicts", two_inputs, lambda: {"x": ds({"a": X[:, :5], "b": X[:, 5:]}, Y)}),
    Case("unbatched dataset", dense, lambda: {"x": ds(X, Y, batch=None)}),
    Case("string dataset (None,) batches", text_model, lambda: {"x": ds(TEXT, Y)}),
    Case("string dataset (None, 1) batches", text_model, lambda: {"x": ds(TEXT[:, None], Y)}),
    Case("dataset with y beside it", dense, lambda: {"x": ds(X, Y), "y": Y}),
    Case("dataset with validation_split", dense, lambda: {"x": ds(X, Y), "validation_split": 0.2}),
    Case("numpy integer arguments", dense, lambda: {"x": X, "y": Y, "batch_size": np.int64(16), "epochs": np.int32(1)}),
    Case("steps_per_epoch", dense, lambda: {"x": ds(X, Y), "steps_per_epoch": np.int64(3)}),
    Case("validation_freq", dense, lambda: {"x": X, "y": Y, "validation_data": (X, Y), "validation_freq": 1}),
    Case("object array of numbers", dense, lambda: {"x": X.astype(object), "y": Y}),
    Case("batch_size over the data's length", dense, lambda: {"x": X, "y": Y, "batch_size": 10**12}),
    Case(
        "validation_batch_size over the data's length",
        dense,
        lambda: {"x": X, "y": Y, "validation_data": (X[:20], Y[:20]), "validation_batch_size": 10**13},
    ),
]


def local_fit(case: Case) -> str | None:
    """None when Keras trains it in the kernel, else what Keras raised."""
    kwargs = {"epochs": 1, "verbose": 0, **case.fit()}
    try:
        case.model().fit(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any refusal by Keras counts
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def kernel_then_worker(client: BackendClient, case: Case) -> tuple[str | None, str | None]:
    """(the kernel's refusal, or None; what the worker's fit raises on exactly what would travel, or None)."""
    kwargs = case.fit()
    named = ("x", "y", "batch_size", "epochs", "validation_data")
    fit_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in named}
    try:
        bundle, spec = Training(client).prepare(
            FitRequest(
                case.model(),
                kwargs.get("x"),
                kwargs.get("y"),
                machine_ids="local-cpu",
                batch_size=kwargs.get("batch_size"),
                epochs=kwargs.get("epochs", 1),
                validation_data=kwargs.get("validation_data"),
                fit_kwargs=fit_kwargs,
            ),
        )
    except ValidationError as exc:
        return str(exc), None
    try:
        validate_spec(spec_json(spec), {"local-cpu": ("local", {})})  # as POST /jobs takes it, after the wire
    except ApiError as exc:
        shutil.rmtree(bundle.workdir, ignore_errors=True)
        return None, f"the backend refuses the job: {exc.message}"
    try:
        return None, worker_fit(bundle, spec)
    finally:
        shutil.rmtree(bundle.workdir, ignore_errors=True)


def worker_fit(bundle: Any, spec: JobSpec) -> str | None:
    """The worker's own data loading (fit_data) and model loading over the bundle's bytes, then its fit."""
    names = {key: f"{i:064x}" for i, key in enumerate(bundle.sources)}  # each blob a name, as an upload gives it
    keys = {name: key for key, name in names.items()}

    def fetch(name: str) -> Path:
        path = bundle.workdir / f"blob-{name}"
        if not path.exists():
            with open(path, "wb") as f:
                for chunk in bundle.sources[keys[name]].chunks():
                    f.write(chunk)
        return path

    data = Data.model_validate_json(json.dumps(renamed(bundle.data, names)))
    x, y, sw, validation_data = fit_data(data, fetch)
    fit = spec.fit.model_dump(exclude_unset=True)  # as the worker's agent hands them to Keras
    if fit.get("class_weight"):
        fit["class_weight"] = {int(k): w for k, w in fit["class_weight"].items()}
    try:
        model = keras.saving.load_model(bundle.workdir / "model.keras", safe_mode=spec.safe_mode)
        model.fit(x, y, sample_weight=sw, validation_data=validation_data, verbose=0, **fit)
    except Exception as exc:  # noqa: BLE001 - any refusal by Keras on the worker counts
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def renamed(tree: Any, names: dict[str, str]) -> Any:
    """A data tree with each blob key (a digest, or an upload's placeholder) named by `names`."""
    if isinstance(tree, dict):
        return {k: renamed(v, names) for k, v in tree.items()}
    if isinstance(tree, list):
        return [renamed(v, names) for v in tree]
    return names.get(tree, tree) if isinstance(tree, str) else tree


def test_the_kernel_checks_refuse_exactly_what_keras_refuses(client: BackendClient) -> None:
    """Refused in the kernel only if Keras refuses it there too; passed in the kernel only if it trains on the
    worker. (Passing what the local fit refuses is allowed where the worker trains it: text as a unicode array.)"""
    assert len(CASES) >= 30
    refused_valid, missed = [], []
    for case in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keras_says = local_fit(case)
            we_say, worker_says = kernel_then_worker(client, case)
        if we_say is not None and keras_says is None:
            refused_valid.append(f"{case.name}: refused ({we_say[:300]}) though the local fit trains it")
        if worker_says is not None:
            missed.append(f"{case.name}: passes the kernel checks, then the worker's fit raises {worker_says}")
        if we_say is not None:
            assert ": " in we_say, f"{case.name}: a refusal names the problem and the fix: {we_say}"
    assert not refused_valid, "\n".join(refused_valid)
    assert not missed, "\n".join(missed)
