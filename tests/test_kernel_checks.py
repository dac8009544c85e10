"""Mistakes found in the kernel before anything is written or uploaded (aibro_jupyter/checks.py).

Every error names the argument as the user typed it (`cool_down_period_s` in Python, `--cool-down` in
%%cloud_fit), the bad value and the fix. Each submit case runs against the real embedded backend and checks,
with test_validation's `nothing_uploaded`, that no blob byte arrived and no job was created.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from kernel_helpers import run_cell, start_kernel
from test_magics_kernel import SETUP
from test_validation import TRIPWIRE, fresh_data, nothing_uploaded  # noqa: F401 - a fixture, used by name

from aibro_core.errors import ValidationError
from aibro_jupyter import Training, checks
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.kerasnames import plan_names

from conftest import make_model

pytestmark = pytest.mark.fast


def _submit(client: BackendClient, model: Any, x: Any, y: Any, **kw: Any) -> dict[str, Any]:
    kw.setdefault("machine_ids", "local-cpu")
    return Training(client).submit(FitRequest(model, x, y, **kw))


def two_inputs() -> keras.Model:
    age = keras.Input((4,), name="age")
    text = keras.Input((3,), name="text")
    out = keras.layers.Dense(10, activation="softmax")(keras.layers.Concatenate()([age, text]))
    model = keras.Model({"age": age, "text": text}, out)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy())
    return model


# -- feature shapes and input names -------------------------------------------------------------------------
@pytest.mark.usefixtures("nothing_uploaded")
def test_wrong_feature_shape(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"train_X has shape \(256, 32\).*expects input .* \(None, 64\)"):
        _submit(client, make_model(), x[:, :32], y)


@pytest.mark.usefixtures("nothing_uploaded")
def test_wrong_feature_shape_in_validation_data(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"validation_data\[0\] has shape \(256, 63\)"):
        _submit(client, make_model(), x, y, validation_data=(x[:, :63], y))


@pytest.mark.usefixtures("nothing_uploaded")
def test_reshape_is_suggested_when_the_sizes_agree(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"reshape it: train_X.reshape\(-1, 64\)"):
        _submit(client, make_model(), x.reshape(-1, 8, 8), y)


@pytest.mark.usefixtures("nothing_uploaded")
def test_dict_keys_against_a_two_input_model(client: BackendClient) -> None:
    rng = np.random.default_rng()
    x = {"age": rng.random((64, 4), dtype=np.float32), "txt": rng.random((64, 3), dtype=np.float32)}
    y = rng.integers(0, 10, 64)
    with pytest.raises(ValidationError) as err:
        _submit(client, two_inputs(), x, y)
    message = str(err.value)
    assert "train_X is a dict whose keys do not match the model's inputs ['age', 'text']" in message
    assert "missing ['text']" in message and "unexpected ['txt']" in message
    assert "train_X={'age': ..., 'text': ...}" in message


@pytest.mark.usefixtures("nothing_uploaded")
def test_dict_value_shape_on_a_two_input_model(client: BackendClient) -> None:
    x = {"age": np.zeros((64, 4), "float32"), "text": np.zeros((64, 5), "float32")}
    with pytest.raises(ValidationError, match=r"train_X\['text'\] has shape \(64, 5\).*input 'text' of shape"):
        _submit(client, two_inputs(), x, np.zeros(64, "int32"))


def test_list_and_single_array_on_a_two_input_model() -> None:
    y = np.zeros(8, "int32")
    with pytest.raises(ValidationError, match=r"list of 1 arrays but model .* has 2 input\(s\) \['age', 'text'\]"):
        checks.check_fit_data(two_inputs(), [np.zeros((8, 4))], y, None, None)
    with pytest.raises(ValidationError, match=r"single array but model .* has 2 inputs.*a dict keyed by input name"):
        checks.check_fit_data(two_inputs(), np.zeros((8, 4)), y, None, None)
    checks.check_fit_data(two_inputs(), {"age": np.zeros((8, 4)), "text": np.zeros((8, 3))}, y, None, None)


def test_unknown_inputs_are_skipped_politely() -> None:
    """An unbuilt subclassed model has no known inputs or outputs: nothing to check against, and no crash."""

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(10)

        def call(self, x: Any) -> Any:
            return self.dense(x)

    model = Sub()
    model.compile(loss="sparse_categorical_crossentropy")
    checks.check_fit_data(model, np.zeros((8, 5)), np.arange(8) + 100, None, None)
    checks.check_fit_data({"not": "a model"}, np.zeros((8, 5)), np.arange(8), None, None)


def test_string_inputs_never_crash() -> None:
    """A TextVectorization model takes strings: numpy object/str/bytes arrays and tf string tensors pass the shape
    check and skip the numeric scans."""
    import tensorflow as tf

    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=4)
    vectorize.adapt(["a b c", "d e"])
    for shape in ((1,), ()):
        inp = keras.Input(shape, dtype="string")
        model = keras.Model(inp, keras.layers.Dense(2)(keras.ops.cast(vectorize(inp), "float32")))
        model.compile(loss="sparse_categorical_crossentropy")
        texts = ["a b", "c d e"] * 10
        y = np.zeros(20, "int32")
        for x in (np.array(texts, dtype=object), np.array(texts), np.array(texts, dtype="S"), tf.constant(texts)):
            checks.check_fit_data(model, x, y, None, (x, y))
            assert checks.total_nbytes(x) > 0
        x2 = np.array([texts[:2]] * 20)
        with pytest.raises(ValidationError, match=r"each sample has shape \(2,\).*dtype string"):
            checks.check_fit_data(model, x2, y, None, None)


def test_datasets_are_left_to_the_dataset_checks() -> None:
    import tensorflow as tf

    x, y = fresh_data(32)
    ds = tf.data.Dataset.from_tensor_slices((x[:, :10], y + 50)).batch(8)
    checks.check_fit_data(make_model(), ds, None, None, ds)
    assert checks.total_nbytes(ds) == 0


# -- labels -------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("nothing_uploaded")
@pytest.mark.parametrize(("bad", "low", "high"), [(10, 0, 10), (-1, -1, 9)])
def test_sparse_labels_outside_the_output_units(client: BackendClient, bad: int, low: int, high: int) -> None:
    x, y = fresh_data()
    y[:10] = np.arange(10)
    y[17] = bad
    with pytest.raises(ValidationError) as err:
        _submit(client, make_model(), x, y)
    message = str(err.value)
    assert f"train_Y holds labels from {low} to {high}" in message
    assert "has 10 unit(s)" in message and "labels 0..9" in message
    assert "Dense(N) with N = the number of classes" in message


@pytest.mark.parametrize(
    "loss",
    [
        "sparse_categorical_crossentropy",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.sparse_categorical_crossentropy,
    ],
    ids=["string", "instance", "function"],
)
def test_every_spelling_of_the_sparse_loss(loss: Any) -> None:
    model = make_model()
    model.compile(optimizer="adam", loss=loss)
    x, y = fresh_data(32)
    with pytest.raises(ValidationError, match=r"labels from 0 to 12"):
        checks.check_fit_data(model, x, np.r_[0, y[1:-1], 12], None, None)


def test_ignore_class_is_allowed() -> None:
    model = make_model()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    x, y = fresh_data(32)
    checks.check_fit_data(model, x, np.r_[y[:-1], -1], None, None)


def test_one_hot_labels_with_a_sparse_loss() -> None:
    x, y = fresh_data(32)
    with pytest.raises(ValidationError, match=r"looks one-hot.*argmax\(axis=-1\).*categorical_crossentropy"):
        checks.check_fit_data(make_model(), x, keras.utils.to_categorical(y, 10), None, None)


@pytest.mark.usefixtures("nothing_uploaded")
def test_nan_label_is_an_error(client: BackendClient) -> None:
    x, y = fresh_data()
    y = y.astype("float32")
    y[42] = np.nan
    with pytest.raises(ValidationError, match=r"train_Y holds 1 NaN or inf label\(s\) \(first in row 42\).*Drop"):
        _submit(client, make_model(), x, y)


@pytest.mark.usefixtures("nothing_uploaded")
def test_inf_in_validation_labels_is_an_error(client: BackendClient) -> None:
    x, y = fresh_data()
    yv = y.astype("float64")
    yv[[3, 7]] = np.inf
    with pytest.raises(ValidationError, match=r"validation_data\[1\] holds 2 NaN or inf label\(s\) \(first in row 3\)"):
        _submit(client, make_model(), x, y, validation_data=(x, yv))


@pytest.mark.usefixtures("nothing_uploaded")
def test_nan_in_x_is_a_warning_and_the_job_goes_on(client: BackendClient) -> None:
    """The user may mean it: a warning naming where, then the submit carries on (to the unknown-machine tripwire,
    which stops it before any upload)."""
    x, y = fresh_data()
    x[100, 5] = np.nan
    with pytest.warns(UserWarning, match=r"train_X holds 1 NaN or inf value\(s\) \(first in row 100\)"):
        with pytest.raises(ValidationError, match=rf"unknown machine '{TRIPWIRE}'"):
            _submit(client, make_model(), x, y, machine_ids=TRIPWIRE)


def test_scans_run_in_bounded_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny chunk size: the NaN is found in a later chunk, at its true row, and the label range spans chunks."""
    monkeypatch.setattr(checks, "CHUNK_ELEMENTS", 64 * 3)
    x, y = fresh_data(50)
    x[37, 1] = np.inf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks.check_fit_data(make_model(), x, y, None, None)
    assert any("first in row 37" in str(w.message) for w in caught), [str(w.message) for w in caught]
    y[0], y[45] = 0, 11
    with pytest.raises(ValidationError, match=r"labels from 0 to 11"):
        checks.check_fit_data(make_model(), x, y, None, None)


@pytest.mark.usefixtures("nothing_uploaded")
def test_validation_data_with_a_none_part(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(
        ValidationError, match=r"validation_data\[1\] \(the validation targets\) is None.*=\(x_val, y_val\)"
    ):
        _submit(client, make_model(), x, y, validation_data=(x, None))
    with pytest.raises(ValidationError, match=r"validation_data\[0\] \(the validation inputs\) is None"):
        _submit(client, make_model(), x, y, validation_data=[None, y, None])


# -- job arguments ------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("nothing_uploaded")
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cool_down_period_s": -5}, r"cool_down_period_s cannot be negative, got -5: .*cool_down_period_s=600"),
        ({"cool_down_period_s": float("nan")}, r"cool_down_period_s must be a finite number of seconds, got nan"),
        ({"cool_down_period_s": 8 * 24 * 3600}, r"cool_down_period_s is at most 604800 seconds, got 691200"),
        ({"cool_down_period_s": True}, r"cool_down_period_s must be a number of seconds, got True \(bool\)"),
        ({"description": "d" * 1000}, r"description is 1000 characters long .*limit of 500: shorten it"),
        ({"description": None}, r"description must be a string, got None"),
        ({"wait_request_s": -1}, r"wait_request_s cannot be negative, got -1: .*wait_request_s=60"),
        ({"wait_request_s": "abc"}, r"wait_request_s must be a number of seconds, got 'abc' \(str\)"),
        ({"wait_new_job_create_s": math.inf}, r"wait_new_job_create_s must be a finite number of seconds, got inf"),
        ({"wait_new_job_create_interval": -2}, r"wait_new_job_create_interval cannot be negative"),
        ({"machine_ids": 123}, r"machine_ids must be a machine id, .*got 123 \(int\): pass e.g. machine_ids="),
        ({"machine_ids": ["local-cpu", 7]}, r"machine_ids must list machine ids as strings, but it holds 7 \(int\)"),
    ],
    ids=[
        "cool-neg",
        "cool-nan",
        "cool-week",
        "cool-bool",
        "desc-long",
        "desc-none",
        "wait-neg",
        "wait-str",
        "slot-inf",
        "interval-neg",
        "machines-int",
        "machines-list",
    ],
)
def test_bad_job_arguments(client: BackendClient, kw: dict[str, Any], message: str) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=message) as err:
        _submit(client, make_model(), x, y, **kw)
    assert "cool_down_s" not in str(err.value)


@pytest.mark.usefixtures("nothing_uploaded")
def test_bad_cool_down_through_online_fit(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"^cool_down_period_s cannot be negative"):
        Training.online_fit(make_model(), x, y, machine_ids="local-cpu", cool_down_period_s=-5, verbose=False)


def test_numpy_numbers_are_fine() -> None:
    checks.check_job_args(_job(["a", "b"], np.float32(600), "", np.int64(60), 0, 5))
    checks.check_job_args(_job("a,b", 0, "x" * 500, 0.5, 10, 0.1))


def test_argnames_name_what_the_user_typed() -> None:
    names = {"cool_down_period_s": "--cool-down", "machine_ids": "--machine"}
    with pytest.raises(ValidationError, match=r"^--cool-down cannot be negative, got -5.0: .*e.g. --cool-down 600"):
        checks.check_job_args(_job(None, -5.0, "", 60, 0, 5, names))
    with pytest.raises(ValidationError, match=r"^--machine must be"):
        checks.check_job_args(_job(3, 0, "", 60, 0, 5, names))


def _job(
    machines: Any, cool_down: Any, description: Any, wait: Any, wait_slot: Any, interval: Any, names: Any = None
) -> FitRequest:
    """A request with these job arguments (the checks read nothing else of it)."""
    return FitRequest(
        None,
        None,
        machine_ids=machines,
        description=description,
        cool_down_period_s=cool_down,
        wait_request_s=wait,
        wait_new_job_create_s=wait_slot,
        wait_new_job_create_interval=interval,
        argnames=names,
    )


# -- size ---------------------------------------------------------------------------------------------------
def test_total_nbytes_reads_nothing(tmp_path: Path) -> None:
    import tensorflow as tf

    rows = 3 * 2**30 // 4 // 64
    big = np.memmap(tmp_path / "big.f32", mode="w+", dtype="float32", shape=(rows, 64))
    small = np.zeros((10, 3), "float64")
    assert checks.total_nbytes(big) == rows * 64 * 4
    assert checks.total_nbytes({"a": small, "b": [small, small]}, None, (small,)) == 4 * 240
    assert checks.total_nbytes(tf.zeros((10, 3))) == 120
    assert checks.total_nbytes([[1.0, 2.0], [3.0, 4.0]]) == 32
    assert (tmp_path / "big.f32").stat().st_blocks * 512 < 2**20, "the memmap was written or read into"


def test_size_message() -> None:
    with pytest.raises(ValidationError) as err:
        checks.check_size(3 * 2**30, 2 * 2**30, None, {"train_X": 3 * 2**30 - 1000, "train_Y": 1000})
    message = str(err.value)
    assert "the data (train_X 3.0 GiB, train_Y 1000 bytes) is 3.0 GiB (3221225472 bytes)" in message
    assert "at most 2.0 GiB per job" in message
    assert "train on a sample" in message and "float32" in message and "AIBRO_MAX_JOB_BYTES" in message
    checks.check_size(2 * 2**30, 2 * 2**30)


def _mapped_file_bytes() -> int:
    """This process's resident file-backed pages: reading a memmap's pages (even a sparse file's holes) adds them."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.usefixtures("nothing_uploaded")
def test_a_3gib_memmap_is_refused_at_once_with_nothing_written(
    client: BackendClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = client.policy().max_job_bytes
    assert limit < 3 * 2**30
    data_dir, temp = tmp_path / "data", tmp_path / "temp"
    data_dir.mkdir()
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where a bundle would be written
    rows = 3 * 2**30 // 4 // 64
    x = np.memmap(data_dir / "x.f32", mode="w+", dtype="float32", shape=(rows, 64))  # sparse: costs no disk
    y = np.zeros(rows, "int32")
    mapped_before = _mapped_file_bytes()
    with pytest.raises(ValidationError) as err:
        _submit(client, make_model(), x, y)
    touched = _mapped_file_bytes() - mapped_before
    assert touched < 64 * 2**20, f"{touched / 2**20:.0f} MiB of the memmap were read: the size check came too late"
    assert list(temp.iterdir()) == [], "nothing is written before the size check"
    message = str(err.value)
    assert "train_X 3.0 GiB" in message and f"over the {limit}-byte limit per job" in message
    assert "train on a sample" in message
    assert not list(temp.glob("aibro-bundle-*")), "a bundle directory was created"
    assert (data_dir / "x.f32").stat().st_blocks * 512 < 2**20, "the memmap was read into"


# -- %%cloud_fit in a real kernel ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel(aibro_home: Path, client: BackendClient) -> Any:  # client starts the shared backend first
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


@pytest.mark.parametrize(
    ("flags", "fit", "message"),
    [
        ("--cool-down -5", "model.fit(x_train, y_train)", "--cool-down cannot be negative, got -5.0"),
        ("--cool-down nan", "model.fit(x_train, y_train)", "--cool-down must be a finite number"),
        ("--wait-request -1", "model.fit(x_train, y_train)", "--wait-request cannot be negative"),
        ("--wait-slot -1", "model.fit(x_train, y_train)", "--wait-slot cannot be negative"),
        (f"-d {'d' * 600}", "model.fit(x_train, y_train)", "--description is 600 characters long"),
        ("", "model.fit(x_train, y_train + 1)", "y holds labels from 1 to 10"),
        ("", "model.fit(x_train[:, :32], y_train)", "x has shape (1400, 32)"),
        ("", "model.fit(x_train, y_train, validation_data=(x_val, None))", "validation_data[1] (the validation"),
    ],
    ids=["cool-neg", "cool-nan", "wait-request", "wait-slot", "description", "labels", "shape", "val-none"],
)
def test_cloud_fit_names_the_flag(kernel: Any, client: BackendClient, flags: str, fit: str, message: str) -> None:
    before = client.counters().get("blob_bytes_received", 0), len(client.jobs())
    res = run_cell(kernel, f"%%cloud_fit --machine local-cpu {flags}\n{fit}")
    shown = res.stdout + res.error
    assert message in shown, shown
    assert "cool_down_period_s" not in shown and "cool_down_s" not in shown and "Traceback" not in shown, shown
    assert (client.counters().get("blob_bytes_received", 0), len(client.jobs())) == before


# -- what Keras itself would fail to load, found in the kernel (issue 23 items 4 and 7) ----------------------
def _unregistered_relu(x: Any) -> Any:
    return keras.ops.relu(x)


def test_an_unregistered_function_in_a_layer_argument_is_found_by_its_name() -> None:
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation=_unregistered_relu)])
    model.compile("adam", "sparse_categorical_crossentropy")
    names = plan_names(model)
    assert names.refs == {"_unregistered_relu": {"ref": f"{__name__}:_unregistered_relu"}}
    assert names.local["_unregistered_relu"] is _unregistered_relu


@keras.saving.register_keras_serializable(package="kernel_checks")
class NoKwargs(keras.layers.Layer):
    """As several published examples print it: get_config() extends the base config, __init__ takes no **kwargs; and
    here the argument is kept nowhere (only inside the Dense) and its config forgets it, so neither Keras nor aibro
    can rebuild it (one whose config holds it is rebuilt from that: tests/test_named_objects.py)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(size)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "note": "forgot size"}


@pytest.mark.usefixtures("nothing_uploaded")
def test_a_layer_keras_cannot_load_back_is_refused_with_keras_reason_first(client: BackendClient) -> None:
    """A layer whose own config does not rebuild it is rebuilt from its constructor arguments when the object keeps
    them (tests/test_named_objects.py); one that keeps them nowhere is refused with Keras' reason first."""
    x, y = fresh_data()
    model = keras.Sequential([keras.Input((64,)), NoKwargs(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    with pytest.raises(ValidationError) as err:
        _submit(client, model, x, y)
    message = str(err.value)
    assert message.startswith("NoKwargs.__init__() got an unexpected keyword argument"), message
    assert "super().__init__(**kwargs)" in message and len(message) < 800, message


@pytest.mark.usefixtures("nothing_uploaded")
def test_a_sequential_given_a_dict_is_refused(client: BackendClient) -> None:
    x, y = fresh_data()
    with pytest.raises(ValidationError, match=r"train_X is a dict .* is a Sequential.*train_X=train_X\['features'\]"):
        _submit(client, make_model(), {"features": x}, y)


def test_functions_in_layer_arguments_are_found_wherever_they_sit() -> None:
    @keras.saving.register_keras_serializable(package="kernel_checks")
    def shout(text: Any) -> Any:
        return text

    vec = keras.layers.TextVectorization(max_tokens=10, standardize=shout)
    inp = keras.Input((1,), dtype="string")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Embedding(10, 2)(vec(inp))))
    model.compile("adam", "mse")
    names = plan_names(model)
    assert names.local["kernel_checks>shout"] is shout, names.refs
    assert names.refs["kernel_checks>shout"]["closure"]["name"] == "shout"  # made inside this test: travels as such
