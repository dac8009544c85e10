"""Every bad input gets an error naming the problem and the fix, before anything is uploaded or billed.

Each client-side case runs against the real embedded backend and checks afterwards that the backend received no
blob byte and created no job. The data is fresh random data per test, so an upload that slipped through could
not hide behind content addressing (bytes this user already sent are never sent again).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from aibro_core.errors import ApiError, AuthError, BackendUnreachable, ValidationError
from aibro_core.vocabulary import JOB_FINAL
from aibro_jupyter import Training
from aibro_jupyter.bundle import check_model
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.kerasnames import plan_names

from conftest import kill_workers, make_model
from helpers import wait_for

pytestmark = pytest.mark.fast

Arrays = tuple[np.ndarray, np.ndarray]
TRIPWIRE = "no-such-machine"  # refused before any upload, whatever else is wrong


class Unregistered(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        return x * 2.0


@keras.saving.register_keras_serializable(package="aibro_tests")
class Doubler(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        return x * 2.0


class UnregisteredModel(keras.Model):
    """A subclassed model the worker cannot rebuild: its class is neither registered nor importable there."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(10, activation="softmax")

    def call(self, x: Any) -> Any:
        return self.dense(x)


def unregistered_loss(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def _model_with(layer: keras.layers.Layer) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), layer, keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def fresh_data(n: int = 256) -> Arrays:
    """Random data no test has uploaded before (so any upload would really send bytes)."""
    rng = np.random.default_rng(secrets.randbits(64))
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n).astype("int32")


def _uploaded(client: BackendClient) -> tuple[int, int]:
    return client.counters().get("blob_bytes_received", 0), len(client.jobs())


@pytest.fixture
def nothing_uploaded(client: BackendClient) -> Iterator[None]:
    """Asserts after the test that no byte was uploaded and no job was created on the shared backend.

    A job that slipped through (a product bug) is canceled and followed to its end, so it cannot linger."""
    before = _uploaded(client)
    known = {j.job_id for j in client.jobs()}
    yield
    after = _uploaded(client)
    for job in client.jobs():
        if job.job_id not in known:
            client.cancel(job.job_id)
            wait_for(client, job.job_id, lambda evs: any(_final(e) for e in evs))
    assert after == before, "bytes were uploaded or a job was created before the error"


def _final(event: dict[str, Any]) -> bool:
    return event["type"] == "status" and event["data"].get("status") in JOB_FINAL


def _submit(client: BackendClient, model: Any, x: Any, y: Any, **kw: Any) -> dict[str, Any]:
    kw.setdefault("machine_ids", "local-cpu")
    return Training(client).submit(FitRequest(model, x, y, **kw))


# -- the model ----------------------------------------------------------------------------------------
def test_not_a_keras_model_dict(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"expected a Keras model .*got builtins.dict.*pass the model object"):
        _submit(client, {"not": "a model"}, x, y)


def test_not_a_keras_model_sklearn(client: BackendClient, nothing_uploaded: None) -> None:
    from sklearn.linear_model import LogisticRegression

    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"expected a Keras model .*LogisticRegression.*pass the model object"):
        _submit(client, LogisticRegression(), x, y)


def test_uncompiled_model(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    with pytest.raises(ValidationError, match=r"not compiled: call model.compile\(optimizer=.*loss="):
        _submit(client, model, x, y)


def test_lambda_layer_under_safe_mode(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    model = _model_with(keras.layers.Lambda(lambda t: t * 2.0))
    with pytest.raises(ValidationError, match=r"Lambda layer over a lambda.*opt out with safe_mode=False"):
        _submit(client, model, x, y)
    check_model(model, safe_mode=False)


def test_an_unregistered_custom_layer_is_found_by_the_name_keras_records() -> None:
    """Nothing needs registering (issue 35): the worker finds the class by the name Keras saves, from the code that
    travels (tests/test_named_objects.py and test_models_of_models.py train such models)."""
    names = plan_names(_model_with(Unregistered()))
    assert names.refs["Unregistered"] == {"ref": f"{__name__}:Unregistered"} and Unregistered in names.travel


def test_registered_custom_layer_in_an_importable_module_passes() -> None:
    """A registered custom class is named for travel.py, which sends its module's source (tests/test_code_travel)."""
    assert plan_names(_model_with(Doubler())).travel == [Doubler]
    assert importlib.import_module(Doubler.__module__).Doubler is Doubler


def test_an_unregistered_model_subclass_is_found_by_its_name() -> None:
    x, _ = fresh_data()
    model = UnregisteredModel()
    model(x[:1])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert plan_names(model).refs["UnregisteredModel"] == {"ref": f"{__name__}:UnregisteredModel"}


def test_an_unregistered_custom_loss_is_found_by_its_name() -> None:
    model = make_model()
    model.compile(optimizer="adam", loss=unregistered_loss)
    assert plan_names(model).refs["unregistered_loss"] == {"ref": f"{__name__}:unregistered_loss"}


# -- the data -----------------------------------------------------------------------------------------
def test_length_mismatch(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data(256)
    with pytest.raises(ValidationError, match=r"x has 256 samples but y has 255.*same length"):
        _submit(client, make_model(), x, y[:-1])


def test_validation_length_mismatch(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    xv, yv = fresh_data(40)
    with pytest.raises(ValidationError, match=r"validation x has 40 samples but validation y has 10.*must match"):
        _submit(client, make_model(), x, y, validation_data=(xv, yv[:10]))


def test_data_nested_past_the_limit_is_refused_before_upload(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    deep: Any = x
    for _ in range(8):
        deep = {"inputs": deep}
    with pytest.raises(
        ValidationError, match=r"^train_X\['inputs'\].* more than 8 levels deep: pass a flatter structure"
    ):
        _submit(client, make_model(), deep, y)
    with pytest.raises(ValidationError, match=r"train_X holds 300 entries, over 256: concatenate"):
        _submit(client, make_model(), {f"f{i}": x for i in range(300)}, y)


def test_object_array(client: BackendClient, nothing_uploaded: None) -> None:
    x, _ = fresh_data(256)
    ragged = np.empty(256, dtype=object)
    ragged[:] = [[1, 2], [3]] * 128
    with pytest.raises(ValidationError, match=r"y has dtype=object.*without pickle.*np.asarray\(value, dtype="):
        _submit(client, make_model(), x, ragged)


def test_ragged_python_list(client: BackendClient, nothing_uploaded: None) -> None:
    """A plain ragged list (what dtype=object arrays usually come from) names the problem and a fix too."""
    x, _ = fresh_data(256)
    with pytest.raises(ValidationError) as err:
        _submit(client, make_model(), x, [[1, 2], [3]] * 128)
    message = str(err.value)
    assert message.startswith("train_Y ") and "inhomogeneous" in message  # the problem, in numpy's words
    assert "pad" in message or "dtype=" in message, f"no fix named: {message}"


def _fresh_ds(n: int = 256) -> Any:
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(fresh_data(n))


@pytest.mark.parametrize(
    ("build", "y", "kw", "message"),
    [
        (lambda: _fresh_ds().batch(32).repeat(), None, {}, r"x is an infinite tf.data.Dataset.*drop .repeat\(\)"),
        (lambda: _fresh_ds().take(0).batch(32), None, {}, r"x is an empty tf.data.Dataset"),
        (lambda: _fresh_ds(), None, {}, r"single samples of shape \(64,\), not batches.*add .batch\(batch_size\)"),
        (lambda: _fresh_ds().map(lambda a, b: a).batch(32), None, {}, r"yields single Tensor.*\(inputs, targets\)"),
        (lambda: _fresh_ds().batch(32), np.zeros(256), {}, r"y must come from the dataset, not be passed beside"),
        (lambda: _fresh_ds().batch(32), None, {"fit_kwargs": {"validation_split": 0.2}}, r"validation_split cannot"),
        (lambda: fresh_data()[0], _fresh_ds(), {}, r"y is a tf.data.Dataset, which can only be x or validation_data"),
        (
            lambda: _fresh_ds().batch(32),
            None,
            {"validation_data": _fresh_ds().batch(8).repeat()},
            r"validation_data is an infinite tf.data.Dataset",
        ),
    ],
    ids=["infinite", "empty", "unbatched", "no-targets", "y-beside", "validation-split", "y-dataset", "val-infinite"],
)
def test_dataset_errors(
    client: BackendClient, nothing_uploaded: None, build: Any, y: Any, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        _submit(client, make_model(), build(), y, **kw)


# -- fit arguments and machines -------------------------------------------------------------------------
@pytest.mark.parametrize("epochs", [0, -1, 2.5, True])
def test_bad_epochs(client: BackendClient, nothing_uploaded: None, epochs: Any) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"epochs must be a positive integer, got"):
        _submit(client, make_model(), x, y, epochs=epochs)


@pytest.mark.parametrize("epochs", [0, -1])
def test_bad_epochs_through_online_fit(client: BackendClient, nothing_uploaded: None, epochs: int) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=rf"epochs must be a positive integer, got {epochs}"):
        Training.online_fit(make_model(), x, y, machine_ids="local-cpu", epochs=epochs, verbose=False)


def test_numpy_integer_epochs_are_accepted(client: BackendClient, nothing_uploaded: None) -> None:
    """model.fit(epochs=np.int64(2)) works locally, so it must pass validation (here it stops at the machine)."""
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=rf"unknown machine '{TRIPWIRE}'"):
        _submit(client, make_model(), x, y, epochs=np.int64(2), machine_ids=TRIPWIRE)


def test_unknown_fit_argument(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"\['steps'\] are not supported remotely; supported:.*'epochs'"):
        _submit(client, make_model(), x, y, fit_kwargs={"steps": 3})


def test_unknown_machine(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"unknown machine 'g4dn.xlarge'.*available machines are.*local-cpu"):
        _submit(client, make_model(), x, y, machine_ids="local-cpu,g4dn.xlarge")


def test_spec_the_backend_would_refuse_is_refused_before_upload(client: BackendClient, nothing_uploaded: None) -> None:
    """The kernel runs the backend's own JobSpec model on the spec before a byte leaves (meta has no other check)."""
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"'meta' must be an object of at most 8 short strings, got \{'run': 3\}"):
        _submit(client, make_model(), x, y, meta={"run": 3})
    with pytest.raises(ValidationError, match=r"'meta' must be an object of at most 8 short strings"):
        _submit(client, make_model(), x, y, meta={f"k{i}": "v" for i in range(9)})


# -- the backend itself -----------------------------------------------------------------------------------
def test_backend_unreachable_names_the_url() -> None:
    x, y = fresh_data()
    with pytest.raises(BackendUnreachable, match=r"cannot reach .*http://127.0.0.1:9.*aibro backend start"):
        Training(BackendClient("http://127.0.0.1:9", "x")).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu")
        )


def test_wrong_token(client: BackendClient, nothing_uploaded: None) -> None:
    x, y = fresh_data()
    with pytest.raises(AuthError, match=rf"{client.url} rejected the token.*aibro login.*AIBRO_TOKEN"):
        Training(BackendClient(client.url, "wrong-token")).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu")
        )


def test_backend_refuses_bad_specs_too(client: BackendClient, nothing_uploaded: None) -> None:
    """The same checks hold for a raw POST /jobs: 400 with the problem and the fix, and no job."""
    sha = secrets.token_hex(32)  # a digest nobody uploaded
    base = {"model": sha, "data": {"x": {"blob": sha}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}
    cases = [
        ({"fit": {"epochs": 0}}, r"epochs must be a positive integer, got 0"),
        ({"fit": {"epochs": -1}}, r"epochs must be a positive integer, got -1"),
        ({"machines": ["nope"]}, r"unknown machine 'nope'; available: .*local-cpu"),
        ({"fit": {"epochs": 1, "steps": 3}}, r"fit arguments \['steps'\] cannot travel; allowed: .*epochs"),
        ({"fit": {"epochs": 1, "callbacks": []}}, r"\['callbacks'\] cannot travel"),
        ({}, rf"blob {sha} was not uploaded by this user: PUT /blobs/{sha} first"),
        ({"custom_modules": ["os; rm -rf"]}, r"importable module names"),
        ({"description": "x" * 501}, r"at most 500 characters"),
        ({"machines": []}, r"non-empty list of machine ids"),
    ]
    for override, message in cases:
        with pytest.raises(ApiError, match=message) as err:
            client.t.json("POST", "/jobs", json={**base, **override})
        assert err.value.status == 400, (override, err.value.status)


# -- the per-job data limit, on a backend of our own with a 10 kB limit -----------------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendClient]:
    home = tmp_path_factory.mktemp("limited")
    env = {**os.environ, "AIBRO_MAX_JOB_BYTES": "10000", "AIBRO_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aibro_backend", "--home", str(home)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (home / "backend.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the limited backend did not start"
            time.sleep(0.1)
        url = json.loads((home / "backend.json").read_text())["url"]
        token = json.loads((home / "credentials.json").read_text())["token"]
        client = BackendClient(url, token)
        assert client.policy().max_job_bytes == 10000
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        kill_workers(Path(home))


def test_data_over_the_limit_is_refused_before_upload(limited: BackendClient) -> None:
    x, y = fresh_data(256)  # 256 * 64 float32 = 64 kB, over the 10 kB limit
    before = _uploaded(limited)
    with pytest.raises(ValidationError, match=r"over the 10000-byte limit per job: train on a sample.*float32"):
        Training(limited).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu"))
    assert _uploaded(limited) == before


def test_model_over_the_limit_is_refused_before_upload(limited: BackendClient) -> None:
    """Tiny data (about 1.3 kB) but a model file of about 28 kB: the job is over the limit the backend enforces
    (model + data), so it must be refused up front with a fix, not after the data was sent."""
    x, y = fresh_data(4)
    before = _uploaded(limited)
    with pytest.raises(ValidationError, match=r"over the 10000-byte limit"):
        Training(limited).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu"))
    assert _uploaded(limited) == before
