"""`aibro fit`: a saved model and .npy arrays trained from a terminal, with the same checks as the notebook path."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conftest import make_model
from helpers import aibro_cli


def test_fit_follows_the_job_to_completion(aibro_home: Path, client, digits, tmp_path: Path) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    make_model().save(tmp_path / "m.keras")
    for name, arr in {"x": x[:400], "y": y[:400], "xv": xv, "yv": yv}.items():
        np.save(tmp_path / f"{name}.npy", arr)
    out = aibro_cli(
        aibro_home, "fit", str(tmp_path / "m.keras"), "--x", str(tmp_path / "x.npy"), "--y", str(tmp_path / "y.npy"),
        "--val-x", str(tmp_path / "xv.npy"), "--val-y", str(tmp_path / "yv.npy"), "--epochs", "2", "-m", "local-cpu",
        "-d", "cli fit",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Epoch 1/2" in out.stdout and "Epoch 2/2" in out.stdout and "val_accuracy" in out.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "cli fit")
    assert job.status == "COMPLETED" and [h.epoch for h in job.history] == [1, 2]


def test_fit_refuses_bad_inputs_before_uploading(aibro_home: Path, client, tmp_path: Path) -> None:  # noqa: ANN001
    before = client.counters()
    make_model().save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", np.zeros((10, 64), "float32"))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}] * 10, dtype=object), allow_pickle=True)
    (tmp_path / "m.h5").write_bytes(b"not a model")
    cases = [
        (["fit", str(tmp_path / "m.h5"), "--x", str(tmp_path / "x.npy")], "give a Keras v3 model file"),
        (["fit", str(tmp_path / "m.keras"), "--x", str(tmp_path / "obj.npy")], "not a readable .npy array"),
        (["fit", str(tmp_path / "m.keras"), "--x", str(tmp_path / "x.npy"), "--epochs", "0"], "epochs"),
        (["fit", str(tmp_path / "m.keras"), "--x", str(tmp_path / "x.npy"), "-m", "nope"], "unknown machine 'nope'"),
    ]
    for args, expected in cases:
        out = aibro_cli(aibro_home, *args)
        assert out.returncode == 2 and expected in out.stderr, (args, out.stderr[-500:])
    assert client.counters().get("blob_bytes_received") == before.get("blob_bytes_received"), "nothing was uploaded"
