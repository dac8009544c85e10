"""A job of several workers (issue 37): `Training.online_fit(..., workers=2)` and `%%cloud_fit --workers 2` on the
embedded backend, trained by two real processes on Keras-on-JAX in the worker's sandbox, each epoch checkpointed and
reported as any job's, the weights and optimizer state back in the kernel's own TensorFlow model; what such a job
cannot run is refused in the kernel, naming the piece, before anything is uploaded."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import keras
import numpy as np
import pytest
from backend_proc import own_backend
from gang_layers import Doubled, scaled_crossentropy
from greedy_layer import Greedy
from kernel_helpers import digits_setup, run_cell, start_kernel

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.errors import ValidationError
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.gangcheck import check_model_code, check_workers, tensorflow_use

from conftest import make_model
from helpers import pids_where, wait_for

BATCH = 64  # 1400 rows: 21 full batches and 56 rows, split 28 + 28: every step the one a single fit takes
EPOCHS = 3
STEPS = 22


@keras.saving.register_keras_serializable(package="gangtest")
class TfScale(keras.layers.Layer):
    """A layer whose own code calls TensorFlow: Keras on JAX cannot run it."""

    def call(self, x):  # noqa: ANN001, ANN201
        import tensorflow as tf

        return tf.math.scalar_mul(2.0, x)


@keras.saving.register_keras_serializable(package="gangtest")
class OpsScale(keras.layers.Layer):
    """The same layer written with keras.ops: it runs on any backend."""

    def call(self, x):  # noqa: ANN001, ANN201
        return keras.ops.multiply(x, 2.0)


import tensorflow as tf  # noqa: E402 - after the layers: TfTape's source reads this module's `tf`


class TfTape(keras.Model):
    """A model whose train_step records its own tf.GradientTape."""

    def train_step(self, data):  # noqa: ANN001, ANN201
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.fast
def test_tensorflow_in_the_users_code_is_found_and_named() -> None:
    assert "tf.math.scalar_mul" in (tensorflow_use(TfScale) or "")
    assert "tf.GradientTape" in (tensorflow_use(TfTape) or "")
    assert tensorflow_use(OpsScale) is None
    with pytest.raises(ValidationError, match=r"TfScale calls TensorFlow \(tf\.math\.scalar_mul.*keras\.ops"):
        check_model_code(2, [OpsScale, TfScale], "--workers")
    check_model_code(1, [TfScale])  # one worker trains on TensorFlow, as today
    check_model_code(2, [OpsScale])


@pytest.mark.fast
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"workers": 0}, "--workers must be an integer from 1 to 64"),
        ({"batch_size": 30, "workers": 4}, "batch_size 30 is not a multiple of the 4 workers.*such as 28"),
        ({"validation_data": [1, 2]}, "validation_data as a tuple of NumPy arrays"),
        ({"fit_kwargs": {"validation_batch_size": 33}}, "validation_batch_size 33 is not a multiple of the 2"),
        ({"fit_kwargs": {"class_weight": {0: 1.0}}}, "does not take the fit argument 'class_weight'"),
        ({"train_X": [[0.0] * 64] * 10}, "NumPy arrays.*x is list"),
    ],
)
def test_what_a_job_of_workers_cannot_take_is_refused_by_name(
    digits: tuple[np.ndarray, ...], changes: dict, message: str
) -> None:
    base = {
        "model": make_model(),
        "train_X": digits[0],
        "train_Y": digits[1],
        "workers": 2,
        "batch_size": BATCH,
        "argnames": {"workers": "--workers"},
    }
    with pytest.raises(ValidationError, match=message):
        check_workers(FitRequest(**{**base, **changes}))
    check_workers(FitRequest(**base))  # the same without the change passes


def test_a_tensorflow_only_model_is_refused_before_anything_is_uploaded(client, digits) -> None:  # noqa: ANN001
    model = keras.Sequential([keras.Input((64,)), TfScale(), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    jobs_before = len(client.jobs())
    with pytest.raises(ValidationError, match="TfScale calls TensorFlow"):
        Training.online_fit(model, digits[0], digits[1], "local-cpu", BATCH, EPOCHS, workers=2, verbose=False)
    assert len(client.jobs()) == jobs_before


def test_two_workers_train_the_model_in_place_as_one_fit_would(client, digits) -> None:  # noqa: ANN001
    x, y = digits[0], digits[1]
    held_out = (digits[2][:384], digits[3][:384])  # 6 batches of 64: every validation row seen, as in one fit
    reference = make_model(seed=3)  # the same start, fit in this process on TensorFlow, same batches in order
    ref_history = reference.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, validation_data=held_out, verbose=0
    )
    model = make_model(seed=3)
    job_id, trained, history = Training.online_fit(
        model,
        x,
        y,
        "local-cpu",
        BATCH,
        EPOCHS,
        validation_data=held_out,
        fit_kwargs={"shuffle": False},
        description="gang of two",
        workers=2,
        verbose=False,
    )
    assert trained is model
    assert keras.backend.backend() == "tensorflow"
    assert int(model.optimizer.iterations.numpy()) == STEPS * EPOCHS  # the optimizer state came back too
    # Two engines, the same global batches: within float error of each other (measured gaps ~1e-6).
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history.history[key], rtol=1e-3, err_msg=key)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights(), strict=True))
    assert gap < 1e-2, gap
    view = client.job(job_id)
    assert view.status == v.COMPLETED
    events = client.events(job_id)["events"]
    epochs = [e["data"] for e in events if e["type"] == v.EV_EPOCH]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS)) and all(e["workers"] == 2 for e in epochs)
    assert any(e["type"] == v.EV_BATCH for e in events), "batches are reported as they come"
    said = [str(e["data"].get("message", "")) for e in events if e["type"] == v.EV_LOG]
    assert any("training on 2 workers" in m for m in said), said
    # Each epoch's checkpoint is a model that loads here and holds that epoch's weights: a job resumes from it.
    names = {a.name for a in client.artifacts(job_id)}
    assert {v.checkpoint_name(e) for e in range(EPOCHS)} <= names


def test_cloud_fit_workers_in_a_real_kernel(aibro_home: Path, client, tmp_path: Path) -> None:  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        setup = run_cell(kc, digits_setup(then="model = build()\nmodel_id = id(model)"), timeout=180)
        assert not setup.error, setup.error
        res = run_cell(
            kc,
            f"""%%cloud_fit --machine local-cpu --workers 2 --description "magic gang"
history = model.fit(x_train, y_train, epochs=2, batch_size={BATCH})
print("BACK", id(model) == model_id, len(history.history["loss"]), int(model.optimizer.iterations.numpy()))
""",
            timeout=600,
        )
        assert not res.error, res.error
        assert re.search(rf"BACK True 2 {STEPS * 2}\b", res.stdout), res.stdout
        headers = [str(st.get("value", "")) for st in res.widgets.values() if "aibro-nb-header" in str(st.get("value"))]
        assert any("on local-cpu · 2 workers" in h for h in headers), headers
        refused = run_cell(kc, "%%cloud_fit --machine local-cpu --workers 3\nmodel.fit(x_train, y_train)")
        assert "batch_size 32 is not a multiple of the 3 workers" in refused.stdout + refused.error
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    job = next(j for j in reversed(client.jobs()) if j.description == "magic gang")
    assert job.status == v.COMPLETED


def _member(process_id: int, job_id: str) -> int | None:
    """The pid of the gang member `process_id` of the one gang running (its spec file, member-I.json, is on its
    command line; the job's folder is named after nothing the test knows)."""
    spec = f"member-{process_id}.json".encode()
    found = pids_where(lambda argv: b"aibro_backend.worker.gangfit" in argv and argv[-2].endswith(spec))
    return found[0] if found else None


def test_a_worker_killed_mid_fit_and_the_job_completes_every_epoch_once(client, digits) -> None:  # noqa: ANN001
    x, y = np.tile(digits[0], (4, 1)), np.tile(digits[1], 4)  # epochs long enough to kill a member inside one
    epochs = 5
    job = Training().submit(
        FitRequest(make_model(), x, y, "local-cpu", BATCH, epochs, description="gang loses one", workers=2)
    )
    wait_for(client, job.job_id, lambda evs: any(e["type"] == v.EV_EPOCH for e in evs))
    pid = _member(1, job.job_id)
    assert pid is not None, "member 1 of the gang is running"
    os.kill(pid, signal.SIGKILL)
    events = wait_for(client, job.job_id, lambda evs: client.job(job.job_id).status in v.JOB_FINAL, timeout=900)
    view = client.job(job.job_id)
    assert view.status == v.COMPLETED, view.error
    epochs_seen = [e["data"]["epoch"] for e in events if e["type"] == v.EV_EPOCH]
    assert epochs_seen == list(range(epochs)), epochs_seen  # each epoch once, in order
    said = [str(e["data"].get("message", "")) for e in events if e["type"] == v.EV_LOG]
    assert any(re.search(r"worker 1 of the job's 2 was killed by signal 9: the 2 workers start again", m) for m in said)


def test_early_stopping_stops_every_worker_and_its_best_weights_come_back(client, digits, tmp_path) -> None:  # noqa: ANN001
    x, y = digits[0], digits[1]
    # Never an improvement after the first epoch: all workers stop together after the second, and the model
    # returned holds the first epoch's weights (restore_best_weights).
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0, restore_best_weights=True)
    slower = keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=1e9, patience=0, factor=0.5)
    model = make_model(seed=4)
    job_id, _, history = Training.online_fit(
        model, x, y, "local-cpu", BATCH, 10, fit_kwargs={"callbacks": [stop, slower]}, workers=2, verbose=False
    )
    assert len(history.history["loss"]) == 2, history.history
    first = keras.saving.load_model(client.download_artifact(job_id, v.checkpoint_name(0), tmp_path / "first.keras"))
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), first.get_weights(), strict=True))
    assert float(model.optimizer.learning_rate.numpy()) < 1e-3  # ReduceLROnPlateau's change came back too
    with pytest.raises(ValidationError, match="not yet ModelCheckpoint"):
        Training.online_fit(
            make_model(),
            x,
            y,
            "local-cpu",
            BATCH,
            2,
            fit_kwargs={"callbacks": [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))]},
            workers=2,
            verbose=False,
        )


def test_cancel_ends_every_worker_of_the_gang(client, digits) -> None:  # noqa: ANN001
    x, y = np.tile(digits[0], (4, 1)), np.tile(digits[1], 4)
    job = Training().submit(
        FitRequest(make_model(), x, y, "local-cpu", BATCH, 200, description="gang canceled", workers=2)
    )
    wait_for(client, job.job_id, lambda evs: any(e["type"] == v.EV_EPOCH for e in evs))
    members = [_member(i, job.job_id) for i in range(2)]
    assert None not in members, "both members of the gang are running"
    client.cancel(job.job_id)
    events = wait_for(client, job.job_id, lambda evs: client.job(job.job_id).status in v.JOB_FINAL, timeout=600)
    assert client.job(job.job_id).status == v.CANCELED
    assert len([e for e in events if e["type"] == v.EV_EPOCH]) < 200
    for pid in members:  # gone, not left waiting for the other until a heartbeat bound
        assert not Path(f"/proc/{pid}").exists() or b"gangfit" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_tf_data_pipeline_trains_on_two_workers_as_in_one_fit(client, digits) -> None:  # noqa: ANN001
    import tensorflow as tf

    x, y = digits[0], digits[1]
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).prefetch(2)
    held_out = tf.data.Dataset.from_tensor_slices((digits[2][:384], digits[3][:384])).batch(BATCH)
    reference = make_model(seed=5)
    ref = reference.fit(train, epochs=EPOCHS, validation_data=held_out, verbose=0)
    model = make_model(seed=5)
    _, _, history = Training.online_fit(
        model, train, None, "local-cpu", None, EPOCHS, validation_data=held_out, workers=2, verbose=False
    )
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history.history[key], ref.history[key], rtol=1e-3, err_msg=key)
    assert int(model.optimizer.iterations.numpy()) == STEPS * EPOCHS
    odd = tf.data.Dataset.from_tensor_slices((x, y)).batch(33)
    with pytest.raises(ValidationError, match="batches of 33 are not a multiple of the 2 workers"):
        Training.online_fit(make_model(), odd, None, "local-cpu", None, 1, workers=2, verbose=False)


def test_a_gang_over_its_memory_limit_ends_naming_it_and_is_not_started_again(tmp_path: Path, digits) -> None:  # noqa: ANN001
    """The job's limit counts the agent and every member (their tree); over it, the members are killed, and the
    job ends with the limit's message, not with a restart of a gang that would only hit it again."""
    limit = 5 << 30
    model = keras.Sequential([keras.Input((64,)), Greedy(hold_mb=2500, on_backend="jax"), *make_model().layers])
    model.compile("adam", "sparse_categorical_crossentropy")
    with own_backend(tmp_path / "home", AIBRO_JOB_MAX_MEMORY_BYTES=str(limit)) as backend:
        client = backend.client()
        trainer = Training(client)
        job = trainer.submit(FitRequest(model, digits[0], digits[1], "local-cpu", BATCH, 3, workers=2))
        view = trainer.watch(job.job_id)
        assert view.status == v.CANCELED
        assert view.errors and re.search(r"held .* of memory .* over its limit of 5\.0 GiB", view.errors[-1])
        said = [str(e["data"].get("message", "")) for e in client.events(job.job_id)["events"] if e["type"] == v.EV_LOG]
        assert not any("start again" in m for m in said), said


def test_the_users_own_layer_and_closure_loss_reach_every_worker(client, digits) -> None:  # noqa: ANN001
    """Code of the user's that the model names (a keras.ops layer, a closure loss) travels as for any job, and each
    member of the gang finds it (the objects the spec names, on the agent's import path)."""

    def build() -> keras.Model:
        keras.utils.set_random_seed(6)
        m = keras.Sequential([keras.Input((64,)), Doubled(), keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss=scaled_crossentropy(0.5))
        return m

    x, y = digits[0], digits[1]
    ref = build().fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = build()
    _, _, history = Training.online_fit(
        model, x, y, "local-cpu", BATCH, 2, fit_kwargs={"shuffle": False}, workers=2, verbose=False
    )
    np.testing.assert_allclose(history.history["loss"], ref.history["loss"], rtol=1e-3)


@pytest.mark.fast
def test_a_worker_without_jax_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from aibro_backend.worker import gangrun

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))
    with pytest.raises(gangrun.GangRefused, match=r"no jax: install the worker extra \(pip install 'aibro-backend"):
        gangrun.require_jax(2)
