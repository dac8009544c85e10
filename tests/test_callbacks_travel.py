"""Callbacks travel and do what they do locally (issue 23 item 3): ModelCheckpoint, CSVLogger and TensorBoard write
their files on the worker and each file appears at the kernel-side path while the job runs; LearningRateScheduler
and LambdaCallback take functions defined in a cell (a lambda too); the user's own Callback subclasses, from a
cell and from a module next to the notebook, travel as source and what they print shows in the cell in order with
the epoch lines; ReduceLROnPlateau's learning_rate is in the remote History as in the local one. A callback that
reads a notebook variable that cannot travel is refused before upload, naming the variable."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from kernel_helpers import run_cell, start_kernel
from test_validation import fresh_data, nothing_uploaded  # noqa: F401 - a fixture, used by name

from aibro_core.errors import ValidationError
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model

MODULE = '''
import keras


class CountBatches(keras.callbacks.Callback):
    """A callback from a module next to the notebook: it keeps its argument and prints."""

    def __init__(self, label="batches"):
        super().__init__()
        self.label = label
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1

    def on_epoch_end(self, epoch, logs=None):
        print(f"{self.label} after epoch {epoch}: {self.seen}")
'''

SETUP = """
import os, json, glob
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras
from sklearn.datasets import load_digits
from mycallbacks import CountBatches
d = load_digits()
x = (d.data / 16.0).astype("float32"); y = d.target.astype("int32")
x_train, y_train, x_val, y_val = x[:800], y[:800], x[800:1000], y[800:1000]
def build():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
%load_ext aibro_jupyter
"""

CELL = '''
PREFIX = "cell says"


class Announce(keras.callbacks.Callback):
    """A callback defined in a notebook cell: it reads a notebook constant and prints every epoch."""

    def on_epoch_end(self, epoch, logs=None):
        print(f"{PREFIX} epoch {epoch} val_loss {logs['val_loss']:.3f}")


def halve_after_one(epoch, lr):
    return lr if epoch < 1 else lr * 0.5


def callbacks():
    return [
        keras.callbacks.ModelCheckpoint("ckpt/best-{epoch:02d}.keras", monitor="val_loss", save_best_only=True),
        keras.callbacks.ModelCheckpoint("last.weights.h5", save_weights_only=True),
        keras.callbacks.CSVLogger("train_log.csv"),
        keras.callbacks.TensorBoard(log_dir="tb_logs"),
        keras.callbacks.LearningRateScheduler(halve_after_one),
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: print("lambda saw epoch", epoch)),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5),
        Announce(),
        CountBatches("module says"),
    ]
'''


@pytest.fixture(scope="module")
def notebook(aibro_home: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001
    folder = tmp_path_factory.mktemp("callbacks-notebook")
    (folder / "mycallbacks.py").write_text(MODULE)
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)}, cwd=str(folder))
    for cell in (SETUP, CELL):
        res = run_cell(kc, cell, timeout=180)
        assert not res.error, res.error
    yield kc, folder
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_callbacks_run_remotely_and_their_files_and_prints_come_back(notebook, client) -> None:  # noqa: ANN001
    kc, folder = notebook
    res = run_cell(
        kc,
        """local = build().fit(x_train, y_train, epochs=3, batch_size=100, validation_data=(x_val, y_val),
                    callbacks=callbacks(), verbose=0)
local_keys = sorted(local.history)
import shutil
shutil.rmtree("ckpt"), shutil.rmtree("tb_logs"), os.remove("last.weights.h5"), os.remove("train_log.csv")
model = build()
""",
    )
    assert not res.error, res.error
    res = run_cell(
        kc,
        """%%cloud_fit --machine local-cpu --description "callbacks travel"
history = model.fit(x_train, y_train, epochs=3, batch_size=100, validation_data=(x_val, y_val), callbacks=callbacks())
print("KEYS", json.dumps(sorted(history.history)), json.dumps(local_keys))
print("CKPT", json.dumps(sorted(os.listdir("ckpt"))))
best = sorted(glob.glob("ckpt/*.keras"))[-1]
print("LOADED", keras.saving.load_model(best).count_params() == model.count_params())
print("CSV", len(open("train_log.csv").read().strip().splitlines()))
print("TB", bool(glob.glob("tb_logs/train/events.out.tfevents.*")), bool(glob.glob("tb_logs/validation/*")))
w = build(); w.load_weights("last.weights.h5")
print("WEIGHTS", all(np.array_equal(a, b) for a, b in zip(w.get_weights(), model.get_weights())))
""",
        timeout=600,
    )
    assert not res.error, res.stdout[-3000:] + res.error
    out = res.stdout
    found = re.search(r"KEYS (\[.*?\]) (\[.*?\])", out)
    assert found, out
    keys, local_keys = (json.loads(k) for k in found.groups())
    assert keys == local_keys and "learning_rate" in keys, out
    assert json.loads(re.search(r"CKPT (.*)", out).group(1))[0].startswith("best-0"), out
    assert "LOADED True" in out and "CSV 4" in out and "TB True True" in out and "WEIGHTS True" in out, out
    lines = out.splitlines()
    for epoch in range(3):
        said = lines.index(next(line for line in lines if line.startswith(f"cell says epoch {epoch} ")))
        shown = lines.index(next(line for line in lines if line.startswith(f"Epoch {epoch + 1}/3")))
        assert said < shown, f"epoch {epoch}: the callback's line must come before the epoch's line:\n{out}"
        assert f"lambda saw epoch {epoch}" in out and f"module says after epoch {epoch}: {8 * (epoch + 1)}" in out
    assert "/files/" not in out and "checkpoints-" not in out, "a printed worker path must read as the kernel's"


def test_a_checkpoint_file_is_in_the_kernel_before_its_epoch_is_reported(client: BackendClient, tmp_path: Path) -> None:
    x, y = fresh_data(512)
    target = tmp_path / "ckpt-{epoch:02d}.keras"
    seen: list[tuple[int, bool]] = []

    def watcher(view: Any, ev: dict[str, Any]) -> None:
        if ev["type"] == "epoch":
            epoch = ev["data"]["epoch"] + 1
            seen.append((epoch, (tmp_path / f"ckpt-{epoch:02d}.keras").exists()))

    job = Training(client).submit(
        FitRequest(
            make_model(),
            x,
            y,
            machine_ids="local-cpu",
            epochs=3,
            batch_size=64,
            fit_kwargs={"callbacks": [keras.callbacks.ModelCheckpoint(str(target))]},
        ),
    )
    view = Training(client).watch(job.job_id, [watcher])
    assert view.status == "COMPLETED", view.errors
    assert seen == [(1, True), (2, True), (3, True)]


def test_a_callback_reading_notebook_arrays_runs_with_them_remotely(notebook) -> None:  # noqa: ANN001
    """A cell's callback that reads the notebook's x_val and y_val (keras.io's callbacks do) finds them on the worker:
    they travel as data, as the fit's arrays do; a DataFrame it read would be refused, named."""
    kc, _ = notebook
    res = run_cell(
        kc,
        """
class ValAccuracy(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print("VALACC", round(float(self.model.evaluate(x_val, y_val, verbose=0)[1]), 4))
m2 = build()
""",
    )
    assert not res.error, res.error
    res = run_cell(
        kc,
        """%%cloud_fit --machine local-cpu --quiet
m2.fit(x_train, y_train, epochs=2, callbacks=[ValAccuracy()])
print("KERNEL", round(float(m2.evaluate(x_val, y_val, verbose=0)[1]), 4))
""",
    )
    assert not res.error, res.error
    seen = re.findall(r"VALACC (\S+)", res.stdout)
    assert len(seen) == 2 and f"KERNEL {seen[-1]}" in res.stdout, res.stdout
    res = run_cell(
        kc,
        """import pandas as pd
frame = pd.DataFrame({"a": [1.0]})
class Reads(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(frame)
""",
    )
    res = run_cell(kc, "%%cloud_fit --machine local-cpu\nm2.fit(x_train, y_train, epochs=1, callbacks=[Reads()])")
    shown = res.stdout + res.error
    assert "Reads" in shown and "`frame`" in shown and "numpy array" in shown, shown


@pytest.mark.usefixtures("nothing_uploaded")
def test_a_callback_that_cannot_run_remotely_is_named_with_what_to_do(client: BackendClient) -> None:
    x, y = fresh_data()
    remote = keras.callbacks.RemoteMonitor(root="http://example.invalid")
    with pytest.raises(ValidationError, match=r"RemoteMonitor .* a worker cannot reach .*%cloud_attach"):
        Training(client).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu", fit_kwargs={"callbacks": [remote]})
        )


def test_a_callback_argument_that_cannot_travel_is_named(client: BackendClient) -> None:
    class Holds(keras.callbacks.Callback):
        def __init__(self, data: Any) -> None:
            super().__init__()
            self.data = data

    with pytest.raises(ValidationError, match=r"callback Holds.* is defined inside another function"):
        Training(client).prepare(
            FitRequest(make_model(), *fresh_data(), machine_ids="local-cpu", fit_kwargs={"callbacks": [Holds(1)]})
        )
    from aibro_jupyter.argcodec import encode

    with pytest.raises(ValidationError, match=r"argument 'data' is a builtins.object, which cannot travel"):
        encode(object(), "callback Holds's argument 'data'", [], None)
    with pytest.raises(ValidationError, match=r"argument 'data' is an array of 100000 float64 values: only .* at most"):
        encode(np.zeros(100_000), "callback Holds's argument 'data'", [], None)
    assert encode(np.zeros(3, "float32"), "small", [], None)["__array__"]["shape"] == [3]


def test_a_callback_holding_a_vocabulary_travels_and_one_too_big_is_refused_naming_the_fix(
    client: BackendClient,
) -> None:
    import composite_models as cm

    words = [f"word{i}" for i in range(20_000)]
    bundle, spec = Training(client).prepare(
        FitRequest(
            make_model(), *fresh_data(), machine_ids="local-cpu", fit_kwargs={"callbacks": [cm.Vocabulary(words)]}
        )
    )
    shutil.rmtree(bundle.workdir)
    assert spec.callbacks[0].config["index_to_word"] == words
    huge = ["w" * 40] * 30_000  # about 1.3 MB as JSON: over the request a job spec travels in
    with pytest.raises(ValidationError, match=r"job spec is \d+ characters as JSON.*too big to travel inline"):
        Training(client).prepare(
            FitRequest(
                make_model(), *fresh_data(), machine_ids="local-cpu", fit_kwargs={"callbacks": [cm.Vocabulary(huge)]}
            )
        )
