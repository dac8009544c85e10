"""Shared fixtures: an isolated AIBRO_HOME with a real embedded backend, small real data, small models."""

from __future__ import annotations

import os
import signal
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from aibro_jupyter import config
from aibro_jupyter.client import BackendClient

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def kill_workers(home: Path) -> None:
    """Kill any worker process whose work directory lives under `home` (left by SIGKILLed backends)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"AIBRO_WORKER_DIR={home}".encode() in env:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="session")
def aibro_home(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("aibro-home")
    old = {k: os.environ.pop(k, None) for k in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    os.environ["AIBRO_HOME"] = str(home)
    yield home
    config.stop_embedded()
    kill_workers(home)
    for k, val in old.items():
        if val is not None:
            os.environ[k] = val


@pytest.fixture(scope="session")
def client(aibro_home: Path) -> BackendClient:
    target = config.resolve()
    return BackendClient(target.url, target.token)


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(x))
    x, y = x[idx], y[idx]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def make_model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.fixture
def model():
    return make_model()
