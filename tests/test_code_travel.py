"""The user's own code travels to a worker that shares nothing with the kernel: custom layers, losses and
subclassed models defined in notebook cells, in a module next to the notebook and in a small local package train
remotely from a real kernel and come back as the same classes. Text arrays train too.

The worker is a process started with `python -I` in a private directory (tests/test_worker_isolation.py checks its
environment): the notebook's folder is not on its path, so these classes can only reach it as travelling source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kernel_helpers import run_cell, start_kernel

from aibro_core.models import Job

LAYERS = '''
import keras


@keras.saving.register_keras_serializable(package="travel_tests")
class Scale(keras.layers.Layer):
    """A layer from a module next to the notebook."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}
'''

PKG_INIT = "from .losses import smooth_sparse_ce\n"
PKG_LOSSES = '''
import keras

from ._util import SMOOTH


@keras.saving.register_keras_serializable(package="travel_tests")
def smooth_sparse_ce(y_true, y_pred):
    """A loss from a small local package (it imports a sibling module)."""
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) * (1.0 - SMOOTH)
'''
PKG_UTIL = "SMOOTH = 0.01\n"

SETUP = """
import os, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras, tensorflow as tf
from sklearn.datasets import load_digits
from layers import Scale
from mylib import smooth_sparse_ce
d = load_digits()
x = (d.data / 16.0).astype("float32"); y = d.target.astype("int32")
x_train, y_train, x_val, y_val = x[:1200], y[:1200], x[1200:1400], y[1200:1400]
keras.utils.set_random_seed(0)
%load_ext aibro_jupyter
"""

CELL_DEFS = '''
UNITS = 16

@keras.saving.register_keras_serializable(package="travel_cells")
class Gate(keras.layers.Layer):
    """A custom layer defined in a notebook cell: it reads a notebook constant and a module next to it."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return Scale(1.0)(x) * self.w


@keras.saving.register_keras_serializable(package="travel_cells")
def cell_loss(y_true, y_pred):
    return smooth_sparse_ce(y_true, y_pred)


@keras.saving.register_keras_serializable(package="travel_cells")
class Net(keras.Model):
    """A subclassed model defined in a cell, compiled but never built."""

    def __init__(self, units=UNITS, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.gate = Gate()
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(10, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(self.gate(x)))

    def get_config(self):
        return {**super().get_config(), "units": self.units}
'''


@pytest.fixture(scope="module")
def notebook(aibro_home: Path, client, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001
    """A notebook folder with ./layers.py and ./mylib/, and a kernel started in it."""
    folder = tmp_path_factory.mktemp("notebook")
    (folder / "layers.py").write_text(LAYERS)
    (folder / "mylib").mkdir()
    (folder / "mylib" / "__init__.py").write_text(PKG_INIT)
    (folder / "mylib" / "losses.py").write_text(PKG_LOSSES)
    (folder / "mylib" / "_util.py").write_text(PKG_UTIL)
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)}, cwd=str(folder))
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    res = run_cell(kc, CELL_DEFS)
    assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def _job(client, description: str) -> Job:  # noqa: ANN001
    return next(j for j in reversed(client.jobs()) if j.description == description)


def test_cell_and_module_code_travels_and_comes_back_as_the_same_classes(notebook, client) -> None:  # noqa: ANN001
    res = run_cell(
        notebook,
        """
inp = keras.Input((64,))
h = Gate()(Scale(2.0)(inp))
model = keras.Model(inp, keras.layers.Dense(10, activation="softmax")(h))
model.compile(optimizer="adam", loss=cell_loss, metrics=["accuracy"])
model_id = id(model)
""",
    )
    assert not res.error, res.error
    res = run_cell(
        notebook,
        """%%cloud_fit --machine local-cpu --description "travel functional"
history = model.fit(x_train, y_train, epochs=2, batch_size=64, validation_data=(x_val, y_val))
print("SAME", id(model) == model_id, type(model.layers[1]) is Scale, type(model.layers[2]) is Gate)
print("KEYS", json.dumps(sorted(history.history)))
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "SAME True True True" in res.stdout, res.stdout
    keys = json.loads(re.search(r"KEYS (.*)", res.stdout).group(1))
    assert keys == ["accuracy", "loss", "val_accuracy", "val_loss"]
    job = _job(client, "travel functional")
    paths = sorted(f.path for f in job.code)
    assert paths == ["__aibro_main__.py", "layers.py", "mylib/__init__.py", "mylib/_util.py", "mylib/losses.py"]
    assert not any("site-packages" in p or p.startswith(("keras", "numpy", "tensorflow")) for p in paths)


def test_travelling_cell_source_is_the_definitions_not_a_pickle(notebook, client) -> None:  # noqa: ANN001
    res = run_cell(
        notebook,
        "from aibro_jupyter.travel import plan_code\n"
        "plan = plan_code([Gate, cell_loss])\n"
        "print(plan.files['__aibro_main__.py'])\n"
        "print('MODULES', plan.modules)\n",
    )
    assert not res.error, res.error
    assert "class Gate(keras.layers.Layer):" in res.stdout and "def cell_loss(" in res.stdout
    assert "from layers import Scale" in res.stdout and "import keras" in res.stdout
    assert "Net" not in res.stdout.split("MODULES")[0], "only what the model names travels"
    assert "MODULES ['__aibro_main__']" in res.stdout


def test_same_code_uploads_once(notebook, client) -> None:  # noqa: ANN001
    before = client.counters().get("blob_bytes_received", 0)
    res = run_cell(
        notebook,
        """%%cloud_fit --machine local-cpu --description "travel again"
history = model.fit(x_train, y_train, epochs=1, batch_size=64, validation_data=(x_val, y_val))
""",
    )
    assert not res.error, res.error
    sent = client.counters().get("blob_bytes_received", 0) - before
    model_bytes = notebook_model_bytes(notebook)
    assert sent <= model_bytes + 1024, f"only the trained model changed, yet {sent} bytes were sent"
    first, again = _job(client, "travel functional"), _job(client, "travel again")
    assert [f.sha256 for f in first.code] == [f.sha256 for f in again.code]


def notebook_model_bytes(kc) -> int:  # noqa: ANN001
    """The size of the kernel's model as a .keras file (the one blob that changes between two fits)."""
    res = run_cell(
        kc,
        "import tempfile, pathlib\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    model.save(d + '/m.keras'); print('SIZE', pathlib.Path(d, 'm.keras').stat().st_size)\n",
    )
    assert not res.error, res.error
    return int(re.search(r"SIZE (\d+)", res.stdout).group(1))


def test_subclassed_cell_model_compiled_but_never_built(notebook, client) -> None:  # noqa: ANN001
    res = run_cell(
        notebook,
        """net = Net()
net.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
print("BUILT", net.built)
""",
    )
    assert "BUILT False" in res.stdout, res.stdout + res.error
    res = run_cell(
        notebook,
        """%%cloud_fit --machine local-cpu --description "travel subclassed"
history = net.fit(x_train, y_train, epochs=2, batch_size=100)
print("STEPS", int(net.optimizer.iterations.numpy()), len(net.weights) > 0, type(net).__name__)
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "STEPS 24 True Net" in res.stdout, res.stdout  # 12 batches x 2 epochs: optimizer state came back
    job = _job(client, "travel subclassed")
    res = run_cell(
        notebook,
        f"%cloud_result {job.job_id} --into remote_net\n"
        "print('SAME', type(remote_net) is Net, remote_net is not net,\n"
        "      all(np.array_equal(a, b) for a, b in zip(net.get_weights(), remote_net.get_weights())))\n",
    )
    assert "SAME True True True" in res.stdout, res.stdout + res.error  # the trained weights are in the user's object


TEXT = """
texts = ["a good movie", "a bad film", "great plot and cast", "awful acting", "loved it", "hated it"] * 20
labels = np.array([1, 0, 1, 0, 1, 0] * 20, dtype="int32")
def text_model():
    keras.utils.set_random_seed(1)
    vec = keras.layers.TextVectorization(max_tokens=40, output_sequence_length=5)
    vec.adapt(np.array(texts, dtype=object))
    m = keras.Sequential([keras.Input((), dtype="string"), vec, keras.layers.Embedding(40, 4),
                          keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return m
local_keys = sorted(text_model().fit(np.array(texts, dtype=object), labels, epochs=1, verbose=0).history)
print("LOCAL", json.dumps(local_keys))
"""


@pytest.mark.parametrize(
    "x_expr",
    ["np.array(texts, dtype=object)", "np.array(texts)", "tf.constant(texts)"],
    ids=["object-array", "unicode-array", "tf-constant"],
)
def test_text_inputs_train_remotely(notebook, client, x_expr: str) -> None:  # noqa: ANN001
    res = run_cell(notebook, TEXT)
    assert not res.error, res.error
    local = json.loads(re.search(r"LOCAL (.*)", res.stdout).group(1))
    res = run_cell(notebook, f"tm = text_model()\nxt = {x_expr}\n")
    assert not res.error, res.error
    res = run_cell(
        notebook,
        """%%cloud_fit --machine local-cpu --description "text" --quiet
h = tm.fit(xt, labels, epochs=2, batch_size=16)
print("KEYS", json.dumps(sorted(h.history)))
""",
    )
    assert not res.error, res.stdout[-2000:] + res.error
    assert json.loads(re.search(r"KEYS (.*)", res.stdout).group(1)) == local
