"""The README's main command and the seed-style script, run as a user runs them, against the test backend."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from aibro_jupyter.client import BackendClient

from helpers import run_as_user

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, home: Path) -> str:
    out = run_as_user(home, [sys.executable, str(ROOT / "examples" / script)], timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _final_accuracy(out: str) -> float:
    found = re.findall(r"final validation accuracy.*: ([0-9.]+)", out)
    assert len(found) == 1, out[-2000:]
    return float(found[0])


@pytest.mark.parametrize("script", ["run_quickstart.py", "quickstart.py"])
def test_quickstart_trains_on_the_embedded_backend(script: str, aibro_home: Path, client: BackendClient) -> None:
    before = {j["job_id"] for j in client.jobs()}
    out = _run(script, aibro_home)
    for k in range(1, 9):
        assert f"Epoch {k}/8" in out, out[-2000:]
    assert out.count("Epoch 8/8") == 1, "each epoch is printed once"
    assert _final_accuracy(out) > 0.85
    new = [j for j in client.jobs() if j["job_id"] not in before]
    assert len(new) == 1 and new[0]["status"] == "COMPLETED" and new[0]["epochs_done"] == 8
    assert new[0]["description"] == "quickstart digits cnn"
