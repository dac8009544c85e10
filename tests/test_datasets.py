"""tf.data datasets as training and validation data: saved once in the kernel, loaded on the worker, trained."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from aibro_backend.worker.datatree import load_dataset
from aibro_core.errors import ApiError
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.dataset_blob import save_dataset
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import wait_for

EPOCHS = 3


def _pairs(x: np.ndarray, y: np.ndarray, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def test_online_fit_trains_on_datasets(client: BackendClient, digits) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).batch(32)
    model = make_model()
    with pytest.warns(UserWarning, match=r"x shuffles in its pipeline.*same order"):
        job_id, trained, history = Training.online_fit(
            model, train, None, machine_ids="local-cpu", epochs=EPOCHS, validation_data=_pairs(xv, yv, 64)
        )
    assert trained is model and history.epoch == list(range(EPOCHS))
    assert set(history.history) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    loss, acc = model.evaluate(xv, yv, verbose=0)
    assert acc == pytest.approx(history.history["val_accuracy"][-1], abs=1e-4) and acc > 0.7
    assert int(model.optimizer.iterations.numpy()) == int(np.ceil(len(x) / 32)) * EPOCHS, "steps per epoch"
    epochs = [e for e in client.events(job_id, 0)["events"] if e["type"] == "epoch"]
    assert [e["data"]["epoch"] for e in epochs] == list(range(EPOCHS))


def test_the_same_dataset_uploads_nothing_the_second_time(client: BackendClient) -> None:
    rng = np.random.default_rng(7)  # data no other test sent, so the first submit really uploads
    x, y = rng.random((512, 64), dtype=np.float32), rng.integers(0, 10, 512).astype("int32")
    received, model = [], make_model()  # one model object: a new one would get new layer names, new bytes
    for _ in range(2):
        before = client.counters().get("blob_bytes_received", 0)
        job = Training(client).submit(FitRequest(model, _pairs(x, y, 64), None, machine_ids="local-cpu", epochs=1))
        received.append(client.counters().get("blob_bytes_received", 0) - before)
        wait_for(client, job.job_id, lambda evs: any(e["data"].get("status") == "COMPLETED" for e in evs))
    assert received[0] > x.nbytes and received[1] == 0, received


def test_saved_dataset_is_byte_stable_and_loads_back(tmp_path: Path) -> None:
    x = np.arange(200, dtype="float32").reshape(100, 2)
    ds = _pairs(x, np.arange(100), 16)
    a = save_dataset(ds, tmp_path / "a.tar").read_bytes()
    b = save_dataset(ds, tmp_path / "b.tar").read_bytes()
    assert a == b, "same elements, same bytes: content addressing can skip the upload"
    blob = tmp_path / "blobs" / "sha"
    blob.parent.mkdir()
    blob.write_bytes(a)
    loaded = list(load_dataset(blob))
    assert len(loaded) == 7 and np.array_equal(np.concatenate([bx for bx, _ in loaded]), x)
    assert list(load_dataset(blob)) and (tmp_path / "blobs" / "sha.dataset").is_dir(), "unpacked once, reused"


@pytest.mark.fast
def test_a_dataset_is_private_in_the_kernel_and_on_the_worker(tmp_path: Path) -> None:
    """The tar the kernel writes is 0600 whatever its umask, and so are the files it holds; the worker unpacks
    every file 0600 and every folder 0700, even from a tar whose files say 0644 (what an older kernel sent)."""
    x = np.arange(200, dtype="float32").reshape(100, 2)
    old = os.umask(0o022)
    try:
        tar = save_dataset(_pairs(x, np.arange(100), 16), tmp_path / "a.tar")
    finally:
        os.umask(old)
    assert stat.S_IMODE(tar.stat().st_mode) == 0o600
    with tarfile.open(tar) as t:
        assert {m.mode for m in t.getmembers()} == {0o600}
    loose = tmp_path / "blobs" / "sha"
    loose.parent.mkdir()
    with tarfile.open(tar) as t, tarfile.open(loose, "w", format=tarfile.GNU_FORMAT) as out:
        for member in t.getmembers():
            out.addfile(member.replace(mode=0o644), t.extractfile(member))
    done = subprocess.run(  # under the worker's own umask (agent.py, spare.py), as it runs there
        [sys.executable, "-c", "import os, sys, pathlib; os.umask(0o077); from aibro_backend.worker.datatree "
         "import load_dataset; print(len(list(load_dataset(pathlib.Path(sys.argv[1])))))", str(loose)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.split()[-1:] == ["7"], done.stderr[-2000:]
    unpacked = loose.with_name("sha.dataset")
    modes = {p.relative_to(unpacked).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in unpacked.rglob("*")}
    assert modes and all(m == (0o700 if (unpacked / p).is_dir() else 0o600) for p, m in modes.items()), modes
    assert stat.S_IMODE(unpacked.stat().st_mode) == 0o700


def test_worker_refuses_a_tar_that_reaches_outside(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "evil"
    blob.parent.mkdir()
    with tarfile.open(blob, "w") as tar:
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(tarfile.OutsideDestinationError):
        load_dataset(blob)
    assert not list(tmp_path.rglob("escaped.txt"))


def test_backend_accepts_a_dataset_only_as_x(client: BackendClient) -> None:
    sha = "0" * 64
    spec = {"model": sha, "machines": ["local-cpu"], "data": {"x": {"blob": sha}, "y": {"dataset": sha}}}
    with pytest.raises(ApiError, match=r"data.y cannot be a dataset: only data.x and data.validation.x can"):
        client.t.json("POST", "/jobs", json=spec)  # as a client that skips the kernel's checks sends it
    spec["data"] = {"x": {"dataset": sha}, "y": {"blob": sha}}
    with pytest.raises(ApiError, match=r"dataset, which yields its own targets: y and sample_weight must be null"):
        client.t.json("POST", "/jobs", json=spec)


def test_a_loaded_dataset_gives_every_epoch_the_same_elements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's copy prefetches and, when it fits the memory budget, is cached after its first epoch: each epoch
    still gets every element once, in the saved order, whether it came from the files or from the cache."""
    from aibro_backend.worker import datatree

    x = np.arange(200, dtype="float32").reshape(100, 2)
    blob = tmp_path / "sha"
    blob.write_bytes(save_dataset(_pairs(x, np.arange(100), 16), tmp_path / "a.tar").read_bytes())
    for budget in (1 << 30, 0):  # cached, then too big for the budget: read from the files every epoch
        monkeypatch.setattr(datatree, "cache_max_bytes", lambda budget=budget: budget)
        ds = load_dataset(blob)
        for _ in range(2):
            got = [bx.numpy() for bx, _ in ds]
            assert len(got) == 7 and np.array_equal(np.concatenate(got), x)


def test_a_pydatasets_batches_travel_whole_and_come_in_a_new_order_each_epoch(
    client: BackendClient, tmp_path: Path
) -> None:
    """A keras.utils.PyDataset travels as the dataset of its items (one batch each, the last one short); fit's
    shuffle (on by default) reorders them each epoch on the worker, as Keras reorders a PyDataset's."""
    import composite_models as cm

    from aibro_backend.worker.datatree import load_tree
    from aibro_core.models import DataTop

    x = np.arange(200, dtype="float32").reshape(100, 2)
    y = np.arange(100, dtype="float32").reshape(100, 1)
    model = keras_model()
    for shuffle in (True, False):
        bundle, spec = Training(client).prepare(
            FitRequest(model, cm.Batches(x, y, 16), machine_ids="local-cpu", fit_kwargs={"shuffle": shuffle})
        )
        node = bundle.data["x"]  # the spec names it by a stand-in until the upload names it
        assert ("shuffle_batches" in node) is shuffle and (spec.data.x.shuffle_batches is True) is shuffle, node
        blob = tmp_path / (("a" if shuffle else "b") * 64)
        blob.write_bytes(Path(bundle.sources[node["dataset"]].path).read_bytes())
        shutil.rmtree(bundle.workdir)
        ds = load_tree(DataTop.model_validate({**node, "dataset": blob.name}), lambda sha: tmp_path / sha)
        orders = [[int(by[0, 0]) for _, by in ds] for _ in range(3)]
        assert all(sorted(o) == list(range(0, 100, 16)) for o in orders), orders
        assert (len({tuple(o) for o in orders}) > 1) is shuffle, orders


def keras_model() -> object:
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model
