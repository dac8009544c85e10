"""The README's commands, run as a user runs them, against the test backend: each epoch line shows as it happens,
no TensorFlow native log line reaches the user, and the last lines say the backend keeps running and how to stop it."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from aibro_jupyter import config
from aibro_jupyter.client import BackendClient

from conftest import make_model
from helpers import aibro_cli, user_env

ROOT = Path(__file__).resolve().parent.parent
NATIVE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl)|cuInit", re.M)


@dataclass
class Run:
    stdout: list[str] = field(default_factory=list)
    stderr: str = ""
    at_first_epoch: tuple[int | None, str] | None = None  # (the script's exit code then, the job's status then)


def _run_streaming(script: str, home: Path, client: BackendClient, before: set[str]) -> Run:
    """Run an example, reading its stdout line by line while it runs; note the state of things at 'Epoch 1/8'."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / script)],
        env=user_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    run = Run()
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    try:
        for line in proc.stdout:
            run.stdout.append(line.rstrip("\n"))
            if line.startswith("Epoch 1/8") and run.at_first_epoch is None:
                new = [j for j in client.jobs() if j.job_id not in before]
                run.at_first_epoch = (proc.poll(), new[-1].status if new else "no job")
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)
    run.stderr = "".join(err)
    assert proc.returncode == 0, "\n".join(run.stdout[-40:]) + run.stderr[-3000:]
    return run


def _final_accuracy(out: str) -> float:
    found = re.findall(r"final validation accuracy.*: ([0-9.]+)", out)
    assert len(found) == 1, out[-2000:]
    return float(found[0])


@pytest.mark.parametrize("script", ["run_quickstart.py", "quickstart.py"])
def test_quickstart_streams_its_epochs_and_says_the_backend_keeps_running(
    script: str, aibro_home: Path, client: BackendClient
) -> None:
    before = {j.job_id for j in client.jobs()}
    run = _run_streaming(script, aibro_home, client, before)
    out = "\n".join(run.stdout)
    for k in range(1, 9):
        assert f"Epoch {k}/8" in out, out[-2000:]
    assert out.count("Epoch 8/8") == 1, "each epoch is printed once"
    assert run.at_first_epoch == (None, "TRAINING"), (
        f"'Epoch 1/8' is printed while the job still trains and the script still runs: {run.at_first_epoch}"
    )
    assert _final_accuracy(out) > 0.85
    new = [j for j in client.jobs() if j.job_id not in before]
    assert len(new) == 1 and new[0].status == "COMPLETED" and new[0].epochs_done == 8
    assert new[0].description == "quickstart digits cnn"

    assert not NATIVE.search(out) and not NATIVE.search(run.stderr), f"native TF lines: {out[:1500]} {run.stderr}"
    if script == "run_quickstart.py":  # the runner says what each step is about to do, as the script's lines do
        said = [line for line in run.stdout if line.startswith("» ")]
        assert said[0].startswith("» starting a Python kernel"), run.stdout[:5]
        gear_up = next(i for i, line in enumerate(run.stdout) if "gearing up a worker" in line)
        first_epoch = next(i for i, line in enumerate(run.stdout) if line.startswith("Epoch 1/8"))
        assert gear_up < first_epoch, "the gear-up is announced before the first epoch"
        first_output = next(line for line in run.stdout if line.strip() and not line.startswith("» "))
        assert first_output.startswith("digits: 1500 images to train on"), "the first output line says what it is"
        kernel_log = aibro_home / "logs" / "quickstart-kernel.log"
        assert kernel_log.is_file() and str(kernel_log) in said[0], "the kernel's log is under AIBRO_HOME"
    target = config.embedded_target()
    assert target is not None
    tail = "\n".join(run.stdout[-4:])
    assert "keeps running in the background" in tail and target.url in tail, tail
    assert str(aibro_home / "backend.log") in tail, "where its log is"
    assert run.stdout[-1].endswith("Stop the backend and its workers with: aibro backend stop"), tail


def test_aibro_fit_prints_no_native_lines_and_no_optimizer_warning(
    aibro_home: Path, client: BackendClient, digits, tmp_path: Path
) -> None:  # noqa: ANN001
    x, y, _xv, _yv = digits
    make_model().save(tmp_path / "fresh.keras")  # never fitted: its optimizer is not built
    np.save(tmp_path / "x.npy", x[:200])
    np.save(tmp_path / "y.npy", y[:200])
    out = aibro_cli(
        aibro_home, "fit", str(tmp_path / "fresh.keras"), "--x", str(tmp_path / "x.npy"),
        "--y", str(tmp_path / "y.npy"), "--epochs", "1", "-m", "local-cpu", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Epoch 1/1" in out.stdout
    assert "Skipping variable loading" not in out.stdout + out.stderr, out.stderr
    assert not NATIVE.search(out.stdout) and not NATIVE.search(out.stderr), out.stderr[-2000:]
