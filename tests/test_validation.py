"""Every bad input gets an error naming the problem and the fix, before anything is uploaded or billed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from aibro_jupyter import Training
from aibro_jupyter.bundle import check_model
from aibro_jupyter.client import BackendClient
from aibro_jupyter.errors import ApiError, AuthError, BackendUnreachable, ValidationError

from conftest import kill_workers, make_model


class Unregistered(keras.layers.Layer):
    def call(self, x):  # noqa: ANN001, ANN201
        return x * 2.0


@keras.saving.register_keras_serializable(package="aibro_tests")
class Doubler(keras.layers.Layer):
    def call(self, x):  # noqa: ANN001, ANN201
        return x * 2.0


def _model_with(layer: keras.layers.Layer) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), layer, keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


@pytest.fixture
def nothing_uploaded(client: BackendClient):
    """Asserts after the test that no byte was uploaded and no job was created."""
    before = (client.counters().get("blob_bytes_received", 0), len(client.jobs()))
    yield
    assert (client.counters().get("blob_bytes_received", 0), len(client.jobs())) == before


def _submit(client: BackendClient, model, x, y, **kw):  # noqa: ANN001, ANN202
    kw.setdefault("machine_ids", "local-cpu")
    return Training(client).submit(model, x, y, **kw)


def test_not_a_keras_model(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"expected a Keras model .*got builtins.dict"):
        _submit(client, {"not": "a model"}, x, y)


def test_uncompiled_model(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    with pytest.raises(ValidationError, match=r"not compiled: call model.compile"):
        _submit(client, model, x, y)


def test_length_mismatch(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"x has 1400 samples but y has 1399.*same length"):
        _submit(client, make_model(), x, y[:-1])


def test_validation_length_mismatch(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    with pytest.raises(ValidationError, match=r"validation x has \d+ samples but validation y has \d+"):
        _submit(client, make_model(), x, y, validation_data=(xv, yv[:10]))


def test_object_arrays(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, _, _, _ = digits
    ragged = np.array([[1, 2], [3]] * 700, dtype=object)
    with pytest.raises(ValidationError, match=r"dtype=object.*without pickle.*np.asarray"):
        _submit(client, make_model(), x, ragged)


@pytest.mark.parametrize("epochs", [0, -1, 2.5, True])
def test_bad_epochs(client: BackendClient, digits, nothing_uploaded, epochs) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"epochs must be a positive integer"):
        _submit(client, make_model(), x, y, epochs=epochs)


def test_unknown_machine(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"unknown machine 'g4dn.xlarge'.*local-cpu"):
        _submit(client, make_model(), x, y, machine_ids="local-cpu,g4dn.xlarge")


def test_lambda_layer_under_safe_mode(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    model = _model_with(keras.layers.Lambda(lambda t: t * 2.0))
    with pytest.raises(ValidationError, match=r"Lambda layer.*safe_mode=False"):
        _submit(client, model, x, y)


def test_unregistered_custom_layer(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"Unregistered.*not registered.*register_keras_serializable"):
        _submit(client, _model_with(Unregistered()), x, y)


def test_registered_custom_layer_names_its_module() -> None:
    assert check_model(_model_with(Doubler())) == [Doubler.__module__]


def test_unknown_fit_argument(client: BackendClient, digits, nothing_uploaded) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(ValidationError, match=r"\['steps'\] are not supported remotely"):
        _submit(client, make_model(), x, y, fit_kwargs={"steps": 3})


def test_dataset_input_is_refused_clearly(client: BackendClient, nothing_uploaded) -> None:
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(np.zeros((4, 64), "float32"))
    with pytest.raises(ValidationError, match=r"tf.data.Dataset.*numpy arrays"):
        _submit(client, make_model(), ds, None)


def test_backend_unreachable_names_the_url() -> None:
    with pytest.raises(BackendUnreachable, match=r"http://127.0.0.1:9.*aibro backend start"):
        Training(BackendClient("http://127.0.0.1:9", "token")).submit(make_model(), np.zeros((4, 64)), np.zeros(4))


def test_wrong_token(client: BackendClient, digits) -> None:  # noqa: ANN001
    x, y, _, _ = digits
    with pytest.raises(AuthError, match=r"rejected the token.*aibro login.*AIBRO_TOKEN"):
        Training(BackendClient(client.url, "wrong-token")).submit(make_model(), x, y, machine_ids="local-cpu")


def test_backend_refuses_bad_specs_too(client: BackendClient) -> None:
    sha = "0" * 64
    base = {"model": sha, "data": {"x": {"blob": sha}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}
    cases = [
        ({"fit": {"epochs": 0}}, "epochs must be a positive integer"),
        ({"machines": ["nope"]}, "unknown machine 'nope'"),
        ({"fit": {"epochs": 1, "callbacks": []}}, "cannot travel"),
        ({}, "was not uploaded by this user"),
        ({"custom_modules": ["os; rm -rf"]}, "importable module names"),
        ({"description": "x" * 501}, "at most 500 characters"),
    ]
    for override, message in cases:
        with pytest.raises(ApiError, match=message) as err:
            client.t.json("POST", "/jobs", json={**base, **override})
        assert err.value.status == 400


def test_data_over_the_limit_is_refused_before_upload(tmp_path: Path, digits) -> None:  # noqa: ANN001
    """A backend whose per-job limit is 10 kB refuses the digits data before a byte is sent."""
    home = tmp_path / "limited"
    env = {**os.environ, "AIBRO_MAX_JOB_BYTES": "10000"}
    proc = subprocess.Popen([sys.executable, "-m", "aibro_backend", "--home", str(home)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (home / "backend.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        url = json.loads((home / "backend.json").read_text())["url"]
        token = json.loads((home / "credentials.json").read_text())["token"]
        limited = BackendClient(url, token)
        x, y, _, _ = digits
        with pytest.raises(ValidationError, match=r"over the 10000-byte limit per job.*sample"):
            Training(limited).submit(make_model(), x, y, machine_ids="local-cpu")
        assert limited.counters().get("blob_bytes_received", 0) == 0
        assert limited.jobs() == []
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        kill_workers(home)
