"""%%cloud_fit in a real kernel: local statements, remote fit, History, the model back in place, and attach
from a new kernel after the first one died."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kernel_helpers import run_cell, start_kernel

SETUP = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras
from sklearn.datasets import load_digits
d = load_digits()
x = (d.data / 16.0).astype("float32"); y = d.target.astype("int32")
x_train, y_train, x_val, y_val = x[:1400], y[:1400], x[1400:], y[1400:]
keras.utils.set_random_seed(0)
def build():
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
model = build()
model_id = id(model)
%load_ext aibro_jupyter
"""


@pytest.fixture(scope="module")
def kernel(aibro_home: Path, client):  # noqa: ANN001 - client starts the shared backend first
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_cloud_fit_runs_fit_remotely_and_the_rest_locally(kernel) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        """%%cloud_fit --machine local-cpu --cool-down 600 --description "magic digits"
x_scaled = x_train * 1.0
history = model.fit(x_scaled, y_train, epochs=3, batch_size=32, validation_data=(x_val, y_val))
acc = model.evaluate(x_val, y_val, verbose=0)[1]
print("FINAL", round(acc, 4), round(history.history["val_accuracy"][-1], 4), id(model) == model_id)
print("STEPS", int(model.optimizer.iterations.numpy()))
""",
    )
    assert not res.error, res.error
    assert "Epoch 3/3" in res.stdout
    final = re.search(r"FINAL (\S+) (\S+) (\S+)", res.stdout)
    assert final and final.group(1) == final.group(2) and final.group(3) == "True", res.stdout
    assert "STEPS 132" in res.stdout  # 44 batches x 3 epochs: optimizer state came back
    assert any("application/vnd.jupyter.widget-view+json" in d for d in res.data), "the progress panel shows"


@pytest.mark.parametrize(
    "cell, message",
    [
        ("%%cloud_fit -m local-cpu\nprint('no fit here')", "no `.fit(...)` call"),
        ("%%cloud_fit -m local-cpu\nmodel.fit(x_train, y_train)\nmodel.fit(x_train, y_train)", "2 `.fit(...)` calls"),
        ("%%cloud_fit -m local-cpu\nnot_a_model = [1]\nnot_a_model.fit(x_train)", "not a Keras model"),
        ("%%cloud_fit -m local-cpu\nif True:\n    model.fit(x_train, y_train)", "statement of its own"),
        ("%%cloud_fit -m nope\nmodel.fit(x_train, y_train)", "unknown machine 'nope'"),
    ],
)
def test_cloud_fit_errors(kernel, cell: str, message: str) -> None:  # noqa: ANN001
    res = run_cell(kernel, cell)
    assert message in res.stdout + res.error, res.stdout + res.error


def test_help_text_for_every_magic(kernel) -> None:  # noqa: ANN001
    for magic in (
        "%%cloud_fit",
        "%cloud_machines",
        "%cloud_jobs",
        "%cloud_attach",
        "%cloud_result",
        "%cloud_cancel",
        "%cloud_timeline",
    ):
        res = run_cell(
            kernel,
            f"print(get_ipython().find_magic('{magic.lstrip('%')}', "
            f"'{'cell' if magic.startswith('%%') else 'line'}').__doc__)",
        )
        assert not res.error and len(res.stdout.strip()) > 20, (magic, res.stdout)


def test_kernel_dies_mid_training_then_attach_in_a_new_kernel(aibro_home: Path, client) -> None:  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    assert not run_cell(kc, SETUP, timeout=180).error
    big = "xb = np.repeat(x_train, 4, axis=0); yb = np.repeat(y_train, 4, axis=0)\n"
    assert not run_cell(kc, big).error
    res = run_cell(
        kc,
        "%%cloud_fit -m local-cpu --cool-down 600\n"
        "history = model.fit(xb, yb, epochs=6, batch_size=16, validation_data=(x_val, y_val))",
        until="Epoch 2/6",
    )
    km.shutdown_kernel(now=True)
    kc.stop_channels()
    job_id = next(j["job_id"] for j in reversed(client.jobs()) if j["epochs"] == 6)
    assert client.job(job_id)["status"] in ("QUEUING", "TRAINING"), "the job outlives its kernel"
    assert "Epoch 2/6" in res.stdout

    km2, kc2 = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        assert not run_cell(kc2, SETUP, timeout=180).error
        res = run_cell(
            kc2,
            f"%cloud_attach {job_id} --into model\n"
            "panel = get_ipython().magics_manager.registry['CloudMagics'].last_panel\n"
            "print('POINTS', panel.curve_points, 'SAME', id(model) == model_id)\n"
            "print('ACC', round(model.evaluate(x_val, y_val, verbose=0)[1], 4), "
            "round(model_history.history['val_accuracy'][-1], 4))",
        )
        assert not res.error, res.error
        for k in range(1, 7):
            assert res.stdout.count(f"Epoch {k}/6 ") == 1, res.stdout
        assert "POINTS 6 SAME True" in res.stdout, res.stdout
        acc = re.search(r"ACC (\S+) (\S+)", res.stdout)
        assert acc and acc.group(1) == acc.group(2)
    finally:
        kc2.stop_channels()
        km2.shutdown_kernel(now=True)
