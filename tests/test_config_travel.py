"""Everything registered that a model's config names travels as source, wherever it sits (issue 23 item 1): a
function as TextVectorization's `standardize` and `split`, as an activation, an initializer, a regularizer and
a constraint; losses and metrics given as functions; a nested layer holding a nested model; a custom optimizer
and a learning-rate schedule. One model uses each kind, half of them defined in a notebook cell and half in a
module next to the notebook, and trains remotely on a worker that shares no file with the kernel. A function Keras
cannot find by name, and a layer Keras cannot load back, are refused in the cell before anything is uploaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kernel_helpers import run_cell, start_kernel

MODULE = '''
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="cfg_mod")
def lower_and_strip(text):
    """TextVectorization(standardize=...)"""
    return tf.strings.regex_replace(tf.strings.lower(text), "[^a-z ]", "")


@keras.saving.register_keras_serializable(package="cfg_mod")
def scaled_tanh(x):
    """Dense(activation=...)"""
    return keras.ops.tanh(x) * 1.5


@keras.saving.register_keras_serializable(package="cfg_mod")
class SmallNormal(keras.initializers.Initializer):
    """Dense(kernel_initializer=...)"""

    def __init__(self, scale=0.05):
        self.scale = scale

    def __call__(self, shape, dtype=None):
        return keras.random.normal(shape, stddev=self.scale, dtype=dtype, seed=3)

    def get_config(self):
        return {"scale": self.scale}


@keras.saving.register_keras_serializable(package="cfg_mod")
def tiny_l2(weights):
    """Dense(kernel_regularizer=...)"""
    return 1e-4 * keras.ops.sum(keras.ops.square(weights))


@keras.saving.register_keras_serializable(package="cfg_mod")
class HalvingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Adam(learning_rate=...)"""

    def __init__(self, start=0.01, every=10):
        self.start, self.every = start, every

    def __call__(self, step):
        return self.start * keras.ops.power(0.5, keras.ops.floor(step / self.every))

    def get_config(self):
        return {"start": self.start, "every": self.every}


@keras.saving.register_keras_serializable(package="cfg_mod")
def soft_accuracy(y_true, y_pred):
    """compile(metrics=[...])"""
    return keras.ops.mean(keras.metrics.sparse_categorical_accuracy(y_true, y_pred))
'''

SETUP = """
import os, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras, tensorflow as tf
from configfns import lower_and_strip, scaled_tanh, SmallNormal, tiny_l2, HalvingSchedule, soft_accuracy
rng = np.random.default_rng(0)
words = np.array(["Good!", "bad", "GREAT", "awful?", "fine", "poor"])
texts = np.array([" ".join(rng.choice(words, 4)) for _ in range(240)], dtype=object)
numbers = rng.normal(size=(240, 6)).astype("float32")
labels = (np.char.count(texts.astype(str), "o") % 3).astype("int32")
%load_ext aibro_jupyter
"""

CELL = '''
@keras.saving.register_keras_serializable(package="cfg_cell")
def split_on_space(text):
    """TextVectorization(split=...)"""
    return tf.strings.split(text, sep=" ")


@keras.saving.register_keras_serializable(package="cfg_cell")
class NonNegative(keras.constraints.Constraint):
    """Dense(kernel_constraint=...)"""

    def __call__(self, w):
        return keras.ops.relu(w)


@keras.saving.register_keras_serializable(package="cfg_cell")
def smoothed_loss(y_true, y_pred):
    """compile(loss=...)"""
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) * 0.99


@keras.saving.register_keras_serializable(package="cfg_cell")
class ClippedAdam(keras.optimizers.Adam):
    """A custom optimizer: Adam with a clipnorm of its own."""

    def __init__(self, learning_rate=0.01, **kwargs):
        kwargs.setdefault("clipnorm", 1.0)
        super().__init__(learning_rate=learning_rate, **kwargs)


@keras.saving.register_keras_serializable(package="cfg_cell")
class Tower(keras.layers.Layer):
    """A nested layer that holds a nested Sequential model."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.Sequential([keras.layers.Dense(units, activation=scaled_tanh)])

    def call(self, x):
        return self.inner(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def build():
    keras.utils.set_random_seed(2)
    vec = keras.layers.TextVectorization(
        max_tokens=30, output_sequence_length=4, standardize=lower_and_strip, split=split_on_space
    )
    vec.adapt(texts)
    text_in = keras.Input((1,), dtype="string", name="text")
    num_in = keras.Input((6,), name="num")
    t = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 4)(vec(text_in)))
    h = keras.layers.Dense(
        8,
        activation=scaled_tanh,
        kernel_initializer=SmallNormal(0.1),
        kernel_regularizer=tiny_l2,
        kernel_constraint=NonNegative(),
    )(num_in)
    h = Tower(8)(keras.layers.Concatenate()([t, h]))
    m = keras.Model({"text": text_in, "num": num_in}, keras.layers.Dense(3, activation="softmax")(h))
    opt = ClippedAdam(learning_rate=HalvingSchedule(0.02, 5))
    m.compile(optimizer=opt, loss=smoothed_loss, metrics=[soft_accuracy])
    return m
'''


@pytest.fixture(scope="module")
def notebook(aibro_home: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001
    folder = tmp_path_factory.mktemp("cfg-notebook")
    (folder / "configfns.py").write_text(MODULE)
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)}, cwd=str(folder))
    for cell in (SETUP, CELL):
        res = run_cell(kc, cell, timeout=180)
        assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_every_function_and_class_the_config_names_travels_and_trains(notebook, client) -> None:  # noqa: ANN001
    res = run_cell(
        notebook,
        """m = build()
local = build().fit({"text": texts, "num": numbers}, labels, epochs=2, batch_size=40, verbose=0)
""",
    )
    assert not res.error, res.error
    res = run_cell(
        notebook,
        """%%cloud_fit --machine local-cpu --description "config travel" --quiet
h = m.fit({"text": texts, "num": numbers}, labels, epochs=2, batch_size=40)
print("KEYS", sorted(h.history) == sorted(local.history), sorted(h.history))
print("PRED", m.predict({"text": texts[:4], "num": numbers[:4]}, verbose=0).shape)
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "KEYS True" in res.stdout, res.stdout
    assert "PRED (4, 3)" in res.stdout, res.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "config travel")
    assert job.status == "COMPLETED", job
    assert sorted(f.path for f in job.code) == ["__aibro_main__.py", "configfns.py"]
    res = run_cell(
        notebook,
        "from aibro_jupyter.kerasnames import plan_names\n"
        "from aibro_jupyter.travel import plan_code\n"
        "print(plan_code(plan_names(m, globals()).travel).files['__aibro_main__.py'])\n",
    )
    assert not res.error, res.error
    for name in ("split_on_space", "NonNegative", "smoothed_loss", "ClippedAdam", "Tower"):
        assert re.search(rf"^(def|class) {name}\b", res.stdout, re.M), f"{name} did not travel:\n{res.stdout}"
    assert "from configfns import" in res.stdout  # the cell's Tower reads scaled_tanh from the module
