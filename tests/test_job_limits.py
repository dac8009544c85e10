"""What one job may take (issue 24 item 3), replayed from the user's side against a backend whose operator set the
limits (AIBRO_JOB_MAX_*): a layer that opens more files than allowed, one that writes a file over the disk limit,
one whose folder grows past it across files, and one that holds more memory than allowed; each job ends with a
message naming the limit and where it is set."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
from backend_proc import own_backend
from greedy_layer import Greedy

from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import slow_data

LIMITS = {
    "AIBRO_JOB_MAX_OPEN_FILES": "256",
    "AIBRO_JOB_MAX_DISK_BYTES": str(8 << 20),
    "AIBRO_JOB_MAX_MEMORY_BYTES": str(3 << 29),  # 1.5 GiB; a worker with TensorFlow loaded held 0.7 GiB here
}


def greedy_model(**greed: int) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), Greedy(**greed), *make_model().layers])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Training:
    with own_backend(tmp_path_factory.mktemp("limits") / "home", **LIMITS) as backend:
        yield Training(backend.client())


@pytest.mark.parametrize(
    ("greed", "named"),
    [
        ({"files": 400}, r"more than 256 files at once.*AIBRO_JOB_MAX_OPEN_FILES"),
        ({"write_mb": 12}, r"wrote a file over .*AIBRO_JOB_MAX_DISK_BYTES"),
        ({"chunks_mb": 10}, r"folder holds .* over its limit .*AIBRO_JOB_MAX_DISK_BYTES"),
        ({"hold_mb": 1000}, r"held .* of memory .* over its limit of 1.5 GiB .*AIBRO_JOB_MAX_MEMORY_BYTES"),
    ],
    ids=["open-files", "one-big-file", "folder", "memory"],
)
def test_a_job_over_its_limit_ends_naming_it(trainer: Training, greed: dict[str, int], named: str) -> None:
    import re

    x, y = slow_data(512)
    job = trainer.submit(FitRequest(greedy_model(**greed), x, y, machine_ids="local-cpu", epochs=2, batch_size=64))
    view = trainer.watch(job.job_id)
    assert view.status == "CANCELED", "the job should have failed"
    assert view.errors and re.search(named, view.errors[-1]), view.errors


def test_a_job_within_its_limits_trains(trainer: Training, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the files the job writes come back next to the "notebook"
    x, y = slow_data(512)
    job = trainer.submit(
        FitRequest(greedy_model(files=50, chunks_mb=2), x, y, machine_ids="local-cpu", epochs=2, batch_size=64)
    )
    assert trainer.watch(job.job_id).status == "COMPLETED"
    assert sorted(p.name for p in tmp_path.glob("chunk-*.bin")) == ["chunk-0.bin", "chunk-1.bin"]


JOB = """
import json, os, subprocess, sys
from aibro_backend.worker.joblimits import MemoryWatch, OverLimit, tree_rss

before = tree_rss(os.getpid())
hold = "import sys; b = b'x' * (300 << 20); print('ready', flush=True); sys.stdin.read()"
child = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
child.stdout.readline()
found = {"grew": tree_rss(os.getpid()) - before}
with MemoryWatch(before + (100 << 20)) as watch:
    watch.sample()
    try:
        watch.check()
    except OverLimit as exc:
        found["over"] = str(exc)
found["child_left"] = os.path.exists(f"/proc/{child.pid}")
print(json.dumps(found))
"""


@pytest.mark.fast
def test_the_memory_watch_counts_and_ends_the_jobs_processes() -> None:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=120)  # a job of its own
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["grew"] >= 290 << 20, "a child's memory counts as the job's"
    assert "AIBRO_JOB_MAX_MEMORY_BYTES" in found.get("over", ""), found
    assert not found["child_left"], "the job's own processes are ended at once"
