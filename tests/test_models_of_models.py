"""Notebooks shaped like keras.io's VAE, knowledge distillation, the GAN of "customizing fit()" and the siamese
network train remotely as they train in the kernel (issue 35 items 1 to 3): nothing registered, no get_config, no
call(); the same History as the seeded local fit, the trained state (every optimizer's included) back in the same
objects, and what a callback prints in the cell in order with the epoch lines. The classes are in
tests/composite_models.py, so the code that travels is that one file."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import composite_models as cm
import keras
import numpy as np
import pytest
import tensorflow as tf

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from helpers import epochs_seen, instance_pid, wait_for

SEED = 11
FIT = {"shuffle": False}


def _remote(model: Any, x: Any, y: Any = None, epochs: int = 2, batch_size: int | None = 16, **fit: Any) -> Any:
    job_id, trained, history = Training.online_fit(
        model,
        x,
        y,
        machine_ids="local-cpu",
        epochs=epochs,
        batch_size=batch_size,
        cool_down_period_s=120,
        fit_kwargs={**FIT, **fit},
        verbose=False,
    )
    assert trained is model, "the trained state comes back into the same object"
    return history


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(np.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(a, b))


def _images(n: int = 64) -> np.ndarray:
    return np.random.default_rng(SEED).random((n, 8, 8, 1), dtype=np.float32)


def test_a_vae_of_an_encoder_and_a_decoder_trains_remotely_as_in_the_kernel(client: BackendClient) -> None:
    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        vae = cm.VAE(*cm.encoder_decoder())
        vae.compile(optimizer=keras.optimizers.Adam())
        return vae

    local = build()
    expected = local.fit(_images(), epochs=2, batch_size=16, verbose=0, **FIT)
    vae = build()
    before = [w.copy() for w in vae.get_weights()]
    history = _remote(vae, _images())
    assert sorted(history.history) == sorted(expected.history) == ["kl_loss", "loss"]
    assert history.epoch == [0, 1]
    assert _same(history.history["loss"], expected.history["loss"]), (history.history, expected.history)
    assert not _same(vae.get_weights(), before) and _same(vae.get_weights(), local.get_weights())
    assert int(vae.optimizer.iterations.numpy()) == 8 == int(local.optimizer.iterations.numpy())
    assert _same([v.numpy() for v in vae.optimizer.variables], [v.numpy() for v in local.optimizer.variables])
    assert type(vae) is cm.VAE and vae.encoder.name == "encoder"


def test_a_gan_with_two_optimizers_and_no_call_trains_remotely_as_in_the_kernel(client: BackendClient) -> None:
    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        gan = cm.GAN(*cm.gan_parts(), latent_dim=4)
        gan.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
            g_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
        return gan

    def data() -> Any:
        return tf.data.Dataset.from_tensor_slices(_images()).batch(16)

    local = build()
    expected = local.fit(data(), epochs=2, verbose=0)
    gan = build()
    assert not gan.built
    history = _remote(gan, data(), batch_size=None)
    assert sorted(history.history) == ["d_loss", "g_loss"] and history.epoch == [0, 1]
    for key in ("d_loss", "g_loss"):
        assert _same(history.history[key], expected.history[key]), (history.history, expected.history)
    assert _same(gan.get_weights(), local.get_weights())
    for name in ("d_optimizer", "g_optimizer"):
        mine, theirs = getattr(gan, name), getattr(local, name)
        assert int(mine.iterations.numpy()) == 8, f"{name} came back with its state"
        assert _same([v.numpy() for v in mine.variables], [v.numpy() for v in theirs.variables])


def _final(events: list[dict[str, Any]]) -> bool:
    return any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in events)


def test_a_gan_whose_worker_dies_resumes_with_both_optimizers_state(client: BackendClient, aibro_home: Path) -> None:
    """Each epoch's checkpoint of a model made of models carries its own optimizers' state and which weights each
    steps: the job resumes on a new worker and every optimizer counts every step exactly once."""
    gan = cm.GAN(*cm.gan_parts(), latent_dim=4)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
        g_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    data = tf.data.Dataset.from_tensor_slices(_images(4800)).batch(16)
    job_id = (
        Training(client).submit(FitRequest(gan, data, machine_ids="local-cpu", epochs=4, cool_down_period_s=120)).job_id
    )
    wait_for(client, job_id, lambda evs: len(epochs_seen(evs)) >= 2)
    first = client.job(job_id).instance_id
    os.killpg(instance_pid(aibro_home, first), signal.SIGKILL)
    events = wait_for(client, job_id, _final, timeout=600)
    job = client.job(job_id)
    assert job.status == v.COMPLETED and job.instance_id != first, events[-5:]
    assert epochs_seen(events) == [0, 1, 2, 3], "every epoch exactly once, in order"
    Training(client).collect(Training(client).watch(job_id), gan)
    for name in ("d_optimizer", "g_optimizer"):
        assert int(getattr(gan, name).iterations.numpy()) == 300 * 4, f"{name} resumed with its state"


def test_a_distiller_trains_remotely_with_the_teacher_the_kernel_trained(client: BackendClient) -> None:
    rng = np.random.default_rng(SEED)
    x, y = rng.random((96, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 96)

    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        teacher, student = cm.classifier("teacher", 6), cm.classifier("student", 3)
        teacher.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        teacher.fit(x, y, epochs=2, verbose=0, shuffle=False)
        distiller = cm.Distiller(student=student, teacher=teacher)
        distiller.compile(
            optimizer=keras.optimizers.Adam(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            distillation_loss_fn=keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )
        return distiller

    local = build()
    expected = local.fit(x, y, epochs=2, batch_size=16, verbose=0, **FIT)
    distiller = build()
    trained_teacher = [w.copy() for w in distiller.teacher.get_weights()]
    history = _remote(distiller, x, y)
    assert sorted(history.history) == sorted(expected.history) == ["loss", "sparse_categorical_accuracy"]
    assert _same(history.history["loss"], expected.history["loss"]), (history.history, expected.history)
    assert _same(distiller.student.get_weights(), local.student.get_weights())
    assert _same(distiller.teacher.get_weights(), local.teacher.get_weights())
    assert not _same(distiller.teacher.get_weights(), trained_teacher), "this fit steps the teacher too, as locally"


def test_a_siamese_network_with_a_closure_loss_trains_remotely_as_in_the_kernel(client: BackendClient) -> None:
    rng = np.random.default_rng(SEED)
    left, right = rng.random((64, 16), dtype=np.float32), rng.random((64, 16), dtype=np.float32)
    same = rng.integers(0, 2, (64, 1)).astype("float32")

    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        model = cm.siamese()
        model.compile(loss=cm.loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
        return model

    local = build()
    expected = local.fit([left, right], same, epochs=2, batch_size=16, verbose=0, **FIT)
    model = build()
    history = _remote(model, [left, right], same)
    assert sorted(history.history) == ["accuracy", "loss"]
    assert _same(history.history["loss"], expected.history["loss"]), (history.history, expected.history)
    assert _same(model.get_weights(), local.get_weights())


def test_what_a_callback_prints_reaches_the_cell_in_order_with_the_epochs(
    client: BackendClient, capsys: pytest.CaptureFixture[str]
) -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    x = np.ones((32, 4), "float32")
    Training.online_fit(
        model,
        x,
        x[:, :1],
        machine_ids="local-cpu",
        epochs=2,
        cool_down_period_s=120,
        fit_kwargs={"callbacks": [cm.Talks()]},
    )
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith(("talks:", "Epoch "))]
    assert [line.split(" - ")[0] for line in lines] == [
        "talks: epoch 0 ended",
        "Epoch 1/2",
        "talks: epoch 1 ended",
        "Epoch 2/2",
    ], out
    assert "talks: warning at epoch 0\ntalks: warning at epoch 1\n" in err and "talks: warning" not in out


def test_a_pydataset_of_whole_batches_trains_remotely_as_in_the_kernel(client: BackendClient) -> None:
    """Each item of a keras.utils.PyDataset is one batch, remotely as in the kernel (it travels as the dataset of its
    batches, not as one array of them)."""
    rng = np.random.default_rng(SEED)
    x, y = rng.random((100, 8), dtype=np.float32), rng.random((100, 1), dtype=np.float32)

    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile("adam", "mse")
        return model

    local = build()
    expected = local.fit(cm.Batches(x, y, 16), epochs=2, verbose=0, **FIT)
    model = build()
    history = _remote(model, cm.Batches(x, y, 16), batch_size=None)
    assert history.params["steps"] == 7 == expected.params["steps"]
    assert _same(history.history["loss"], expected.history["loss"]), (history.history, expected.history)
    assert _same(model.get_weights(), local.get_weights())


def test_what_the_jobs_code_writes_in_its_working_directory_lands_next_to_the_notebook(
    client: BackendClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback that saves files by a bare name (keras.io's GAN monitors save their images so) leaves them in the
    kernel's working directory, as a local fit does; code files are not brought back."""
    monkeypatch.chdir(tmp_path)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    x = np.ones((32, 4), "float32")
    with pytest.warns(UserWarning, match=r"wrote 'sneaky.py' in its working directory; code.* not brought"):
        _, _, history = Training.online_fit(
            model,
            x,
            x[:, :1],
            machine_ids="local-cpu",
            epochs=2,
            fit_kwargs={"callbacks": [cm.Leaves()]},
            verbose=False,
        )
    for epoch in (0, 1):
        written = (tmp_path / f"generated_{epoch}.txt").read_text()
        assert written == f"epoch {epoch} loss {history.history['loss'][epoch]:.6f}", written
    assert not (tmp_path / "sneaky.py").exists()
