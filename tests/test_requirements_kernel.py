"""Packages travel as a requirements list: the worker installs them into a cached per-requirements environment.

The kernel gets a small pure-Python package from the package index through its own PYTHONPATH (a folder the
worker, started with `python -I`, never sees), so the worker lacks it exactly as a fresh cloud machine would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_helpers import run_cell, start_kernel

PACKAGE = "pyjokes==0.8.3"

LAYERS = '''
import keras
import pyjokes


@keras.saving.register_keras_serializable(package="req_tests")
class Jokey(keras.layers.Layer):
    """A layer whose module needs a package the worker does not have."""

    def call(self, x):
        return x * (1.0 if callable(pyjokes.get_joke) else 0.0)
'''

SETUP = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras
from layers import Jokey
x = np.random.default_rng(0).random((256, 8), dtype=np.float32); y = (x.sum(1) > 4).astype("int32")
def build():
    m = keras.Sequential([keras.Input((8,)), Jokey(), keras.layers.Dense(2, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
%load_ext aibro_jupyter
"""


@pytest.fixture(scope="module")
def kernel(aibro_home: Path, client, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001
    folder = tmp_path_factory.mktemp("req-notebook")
    site = tmp_path_factory.mktemp("kernel-site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), PACKAGE],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (folder / "layers.py").write_text(LAYERS)
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home), "PYTHONPATH": str(site)}, cwd=str(folder))
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_the_worker_lacks_the_package_and_the_kernel_says_which_requirement(kernel) -> None:  # noqa: ANN001
    assert not run_cell(kernel, "m = build()\n").error
    res = run_cell(kernel, "%%cloud_fit --machine local-cpu --description 'no requirements'\nm.fit(x, y, epochs=1)\n")
    out = res.stdout + res.error
    assert "requirements=['pyjokes==0.8.3']" in out, out  # the kernel's warning names the pin to add
    assert "pyjokes" in out and "not installed on the worker" in out, out  # and the worker's error says the same


def test_requirements_install_once_per_hash_and_show_progress(kernel, client, aibro_home: Path) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        f"%%cloud_fit --machine local-cpu --requirements {PACKAGE} --description 'with requirements'\n"
        "h = m.fit(x, y, epochs=2, batch_size=32)\nprint('KEYS', sorted(h.history))\n",
        timeout=600,
    )
    assert not res.error, res.stdout[-3000:] + res.error
    assert "KEYS ['accuracy', 'loss']" in res.stdout
    assert "GEARING UP ENV: installing pyjokes==0.8.3" in res.stdout, res.stdout
    assert "ready (built in" in res.stdout, res.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "with requirements")
    assert job.status == "COMPLETED" and job.requirements == [PACKAGE]
    again = run_cell(
        kernel,
        "m2 = build()\n",
    )
    assert not again.error
    again = run_cell(
        kernel,
        "%%cloud_fit --machine local-cpu --requirements PyJokes==0.8.3 --description 'cached env'\n"
        "m2.fit(x, y, epochs=1)\n",
        timeout=600,
    )
    assert not again.error, again.stdout[-3000:] + again.error
    assert "ready (cached)" in again.stdout and "ready (built in" not in again.stdout, again.stdout
    assert "shared with your next machines" in res.stdout, res.stdout

    # Issue 26 item 6: another machine of the same user (here: this host with its environment cache gone) gets
    # the environment the first one built from the backend instead of resolving and downloading it again.
    for cached in (aibro_home / "state" / "envs").glob("u*/*"):
        shutil.rmtree(cached) if cached.is_dir() else cached.unlink()
    third = run_cell(
        kernel,
        "%%cloud_fit --machine local-cpu --requirements pyjokes==0.8.3 --description 'env from another machine'\n"
        "import pyjokes\nm2.fit(x, y, epochs=1)\n",
        timeout=600,
    )
    assert not third.error, third.stdout[-3000:] + third.error
    assert "ready (downloaded, built by another of your machines" in third.stdout, third.stdout
    assert "ready (built in" not in third.stdout, "pip did not run again"
    shared = next(j for j in reversed(client.jobs()) if j.description == "with requirements")
    assert any(a.name.startswith("envs/") for a in client.artifacts(shared.job_id))


def test_a_requirements_file(kernel, tmp_path: Path) -> None:  # noqa: ANN001
    req = tmp_path / "requirements.txt"
    req.write_text(f"# what the layers need\n{PACKAGE}\n")
    cell = f"%%cloud_fit --machine local-cpu --requirements {req}\nm.fit(x, y, epochs=1)\n"
    res = run_cell(kernel, cell, timeout=600)
    assert not res.error, res.stdout[-3000:] + res.error
    bad = tmp_path / "bad.txt"
    bad.write_text("--index-url https://example.invalid/simple\n")
    res = run_cell(kernel, f"%%cloud_fit --machine local-cpu --requirements {bad}\nm.fit(x, y, epochs=1)\n")
    assert "line 1" in res.stdout + res.error and "index-url" in res.stdout + res.error, res.stdout + res.error


def test_a_different_tensorflow_on_the_worker_is_a_warning_naming_both(client, monkeypatch, capsys) -> None:  # noqa: ANN001
    """The kernel says which versions it runs; the worker compares with its own and the watcher prints why."""
    import numpy as np

    from aibro_jupyter import Training, training

    from conftest import make_model

    monkeypatch.setattr(
        training, "runtime_versions", lambda: {"python": "3.11.0", "tensorflow": "2.5.0", "keras": "2.5.0"}
    )
    rng = np.random.default_rng(3)
    x, y = rng.random((128, 64), dtype=np.float32), rng.integers(0, 10, 128).astype("int32")
    Training.online_fit(make_model(), x, y, machine_ids="local-cpu", epochs=1)
    out = capsys.readouterr().out
    import keras
    import tensorflow as tf

    assert f"TensorFlow 2.5.0 in the kernel but {tf.__version__} on the worker" in out, out
    assert f"Keras 2.5.0 in the kernel but {keras.__version__} on the worker" in out, out
