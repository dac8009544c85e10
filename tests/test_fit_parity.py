"""A remote fit repeats the local one (issue 23 items 5 and 8): after keras.utils.set_random_seed(s), the same
History and the same final weights as the local fit on this CPU and TensorFlow; and fit's arguments, given as any
integer type, behave remotely as in the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_helpers import run_cell, start_kernel

from aibro_jupyter.fitrequest import FitRequest

SETUP = """
import os, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras, tensorflow as tf
from sklearn.datasets import load_digits
d = load_digits()
x = (d.data / 16.0).astype("float32"); y = d.target.astype("int32")
x_train, y_train, x_val, y_val = x[:900], y[:900], x[900:1100], y[900:1100]
def build():
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
def same(a, b):
    return all(np.array_equal(p, q) for p, q in zip(a.get_weights(), b.get_weights()))
%load_ext aibro_jupyter
"""


# The same fit under MirroredStrategy over 2 logical CPU devices, in a process of its own (a process that already
# started TensorFlow cannot split its CPU any more).
MIRRORED_REFERENCE = """
import json, os, sys
import numpy as np
from aibro_backend.worker.agent import split_cpu, training_devices
from aibro_backend.worker.settings import WorkerSettings
split_cpu(WorkerSettings.from_env())
import tensorflow as tf
from conftest import make_model
d = sys.argv[1]
x, y = np.load(d + "/x.npy"), np.load(d + "/y.npy")
start = np.load(d + "/start.npz")
with tf.distribute.MirroredStrategy(devices=training_devices()).scope():
    model = make_model()
model.set_weights([start[f"arr_{i}"] for i in range(len(start.files))])
history = model.fit(x, y, epochs=2, batch_size=64, shuffle=False, verbose=0)
np.savez(d + "/end.npz", *model.get_weights())
print(json.dumps(history.history))
"""


@pytest.fixture(scope="module")
def kernel(aibro_home: Path):  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_a_seeded_notebook_gets_the_local_history_and_weights_remotely(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        """keras.utils.set_random_seed(7)
local_model = build()
local = local_model.fit(x_train, y_train, epochs=3, batch_size=50, validation_data=(x_val, y_val), verbose=0)
keras.utils.set_random_seed(7)
model = build()
""",
    )
    assert not res.error, res.error
    res = run_cell(
        kernel,
        """%%cloud_fit --machine local-cpu --quiet --description "seeded"
history = model.fit(x_train, y_train, epochs=3, batch_size=50, validation_data=(x_val, y_val))
print("HISTORY", json.dumps(history.history == local.history), json.dumps(history.history), json.dumps(local.history))
print("WEIGHTS", same(model, local_model))
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "HISTORY true" in res.stdout, res.stdout
    assert "WEIGHTS True" in res.stdout, res.stdout


def test_an_unseeded_notebook_leaves_the_worker_unseeded(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        "from aibro_jupyter.training import kernel_seed\n"
        "keras.utils.set_random_seed(11)\nprint('SEED', kernel_seed())\n",
    )
    assert "SEED 11" in res.stdout, res.stdout + res.error


# One case per argument of keras.Model.fit (x and y are in each), integers given as NumPy's where they can be.
FIT_CASES = {
    "batch_size": "epochs=2, batch_size=np.int32(100)",
    "epochs": "epochs=np.int64(2), batch_size=100",
    "verbose": "epochs=1, verbose=2",
    "callbacks": "epochs=3, callbacks=[keras.callbacks.EarlyStopping(monitor='loss', patience=0, min_delta=1.0)]",
    "validation_split": "epochs=2, validation_split=0.2",
    "validation_data": "epochs=2, validation_data=(x_val, y_val)",
    "shuffle": "epochs=2, shuffle=False",
    "class_weight": "epochs=2, class_weight={np.int64(k): 1.0 + k / 10 for k in range(10)}",
    "sample_weight": "epochs=2, sample_weight=np.linspace(0.5, 1.5, 900)",
    "initial_epoch": "epochs=3, initial_epoch=np.int64(1), validation_data=(x_val, y_val)",
    "steps_per_epoch": "epochs=2, batch_size=100, steps_per_epoch=np.int16(4)",
    "validation_steps": "epochs=2, validation_data=tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(50), "
    "validation_steps=np.int64(2)",
    "validation_batch_size": "epochs=2, validation_data=(x_val, y_val), validation_batch_size=np.int64(40)",
    "validation_freq": "epochs=3, validation_data=(x_val, y_val), validation_freq=2",
}


def test_every_fit_argument_has_a_case() -> None:
    import inspect

    import keras

    params = set(inspect.signature(keras.Model.fit).parameters) - {"self", "x", "y", "kwargs"}
    assert params == set(FIT_CASES), f"keras.Model.fit takes {sorted(params - set(FIT_CASES))} with no case here"


@pytest.mark.parametrize("param", sorted(FIT_CASES))
def test_each_fit_argument_behaves_remotely_as_in_the_kernel(kernel, client, param: str) -> None:  # noqa: ANN001
    args = FIT_CASES[param]
    res = run_cell(
        kernel,
        f"""keras.utils.set_random_seed(3)
local_model = build()
local = local_model.fit(x_train, y_train, {args})
keras.utils.set_random_seed(3)
model = build()
""",
    )
    assert not res.error, res.error
    res = run_cell(
        kernel,
        f"""%%cloud_fit --machine local-cpu --quiet
history = model.fit(x_train, y_train, {args})
print("SAME", history.history == local.history, history.epoch == local.epoch, same(model, local_model))
print("KEYS", json.dumps(sorted(history.history)), json.dumps(sorted(local.history)))
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "SAME True True True" in res.stdout, res.stdout


def test_two_devices_train_under_mirrored_strategy(tmp_path: Path) -> None:
    """A worker with 2 logical CPU devices (AIBRO_CPU_DEVICES=2, what a 2-GPU machine looks like to the agent)
    trains under MirroredStrategy: it says so with the per-device batch, and the History and the returned weights
    are those of the same fit under MirroredStrategy in this process."""
    import numpy as np
    from backend_proc import own_backend

    from aibro_jupyter import Training
    from aibro_jupyter.progress import JobView, worker_note

    from conftest import make_model

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(512, 64)).astype("float32"), rng.integers(0, 10, 512).astype("int32")
    notes: list[str] = []

    def note(view: JobView, ev: dict) -> None:
        if worker_note(ev) and ev["data"].get("replicas"):
            notes.append(worker_note(ev) or "")

    with own_backend(tmp_path / "home", AIBRO_CPU_DEVICES="2") as backend:
        trainer = Training(backend.client())
        model = make_model()
        start = model.get_weights()
        job = trainer.submit(
            FitRequest(model, x, y, machine_ids="local-cpu", epochs=2, batch_size=64, fit_kwargs={"shuffle": False})
        )
        view = trainer.watch(job.job_id, [note])
        trained, history = trainer.collect(view, model)
    assert view.status == "COMPLETED", view.errors
    assert notes and "MirroredStrategy over 2 devices (CPU:0, CPU:1)" in notes[0] and "32 per device" in notes[0]

    np.save(tmp_path / "x.npy", x), np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "start.npz", *start)
    ran = subprocess.run(
        [sys.executable, "-c", MIRRORED_REFERENCE, str(tmp_path)],
        cwd=Path(__file__).parent,  # beside conftest.py, whose make_model it builds
        env={**os.environ, "AIBRO_CPU_DEVICES": "2", "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    expected = json.loads(ran.stdout.strip().splitlines()[-1])
    want = np.load(tmp_path / "end.npz")
    local_weights = [want[f"arr_{i}"] for i in range(len(want.files))]
    assert sorted(history.history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    for got, expect in zip(trained.get_weights(), local_weights):
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-6)


CUSTOM_MODELS = '''
@keras.saving.register_keras_serializable(package="parity")
class Reconstruct(keras.Model):
    """Trains on inputs alone: its own train_step needs no targets."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encode = keras.layers.Dense(8, activation="relu")
        self.decode = keras.layers.Dense(64)

    def call(self, x):
        return self.decode(self.encode(x))

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(data) - data))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@keras.saving.register_keras_serializable(package="parity")
class OwnCompile(keras.Model):
    """compile() takes arguments of its own, as a GAN's does: an optimizer and a loss function."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(10, activation="softmax")

    def call(self, x):
        return self.dense(x)

    def compile(self, step_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.step_optimizer = step_optimizer
        self.loss_fn = loss_fn

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x))
        grads = tape.gradient(loss, self.trainable_variables)
        self.step_optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def own_compile():
    m = OwnCompile()
    m(x_train[:1])
    m.compile(step_optimizer=keras.optimizers.SGD(0.05), loss_fn=keras.losses.SparseCategoricalCrossentropy())
    return m


def reconstruct():
    m = Reconstruct()
    m(x_train[:1])
    m.compile(optimizer="adam")
    return m
'''


@pytest.mark.parametrize(
    ("make", "fit_args"),
    [
        ("build()", "tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(100).repeat(), steps_per_epoch=4"),
        (
            "build()",
            "tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().batch(64).map(lambda a, b: (a * 2, b)), "
            "steps_per_epoch=np.int64(5)",
        ),
        ("reconstruct()", "tf.data.Dataset.from_tensor_slices(x_train).batch(100)"),
        ("own_compile()", "x_train, y_train, batch_size=100"),
    ],
    ids=["repeated-dataset", "endless-pipeline", "no-targets", "own-compile"],
)
def test_datasets_and_models_keras_trains_train_the_same_remotely(kernel, client, make: str, fit_args: str) -> None:  # noqa: ANN001
    res = run_cell(kernel, CUSTOM_MODELS)
    assert not res.error, res.error
    res = run_cell(
        kernel,
        f"""keras.utils.set_random_seed(5)
local_model = {make}
local = local_model.fit({fit_args}, epochs=3, verbose=0)
keras.utils.set_random_seed(5)
model = {make}
""",
    )
    assert not res.error, res.error
    res = run_cell(
        kernel,
        f"""%%cloud_fit --machine local-cpu --quiet
history = model.fit({fit_args}, epochs=3)
print("SAME", history.history == local.history, same(model, local_model), len(history.epoch))
""",
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "SAME True True 3" in res.stdout, res.stdout
