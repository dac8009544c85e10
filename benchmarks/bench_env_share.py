"""GEARING UP ENV on a user's first machine and on the next one (issue 26 item 6), side by side.

A backend with the local provider trains one short job with requirements: its worker resolves and installs them
from the package index, then shares the environment (a zip of its site-packages, stored as the job's artifact).
The worker's environment cache is then removed, as on a machine that never saw it, and a second job with the same
requirements runs: its worker downloads and unpacks that zip. Each job's GEARING UP ENV seconds come from its
timeline. Beside them, the floor of the second: one in-process unpack of the same zip.

Run: `python benchmarks/bench_env_share.py [--requirements "sympy==1.14.0 cowsay==6.1"] [--keep]`. Needs the
package index (pip) for the first job. See benchmarks/README.md.
"""

from __future__ import annotations

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

import argparse
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from backend_proc import own_backend  # noqa: E402 - the tests' harness

from aibro_core import vocabulary as v  # noqa: E402
from aibro_core.models import Job  # noqa: E402
from aibro_jupyter.client import BackendClient  # noqa: E402
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.timeline_table import per_substatus  # noqa: E402
from aibro_jupyter.training import Training  # noqa: E402

DEFAULT = "statsmodels faker nltk cowsay"  # none of them in the worker's own environment


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def _gear_up_env(client: BackendClient, requirements: list[str], tag: str) -> tuple[float, Job]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 8)).astype("float32"), rng.integers(0, 2, 256)
    job = Training(client).submit(
        FitRequest(_model(), x, y, machine_ids="local-cpu", epochs=1, requirements=requirements, description=tag)
    )
    while (view := client.job(job.job_id)).status not in v.JOB_FINAL:
        time.sleep(0.5)
    if view.status != v.COMPLETED:
        raise SystemExit(f"{tag}: the job ended {view.status}: {view.error}")
    return per_substatus(view.timeline).get(v.GEARING_UP_ENV, 0.0), view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirements", default=DEFAULT, help=f"space-separated (default: {DEFAULT!r})")
    parser.add_argument("--keep", action="store_true", help="keep the backend's home folder")
    args = parser.parse_args()
    requirements = args.requirements.split()
    root = Path(tempfile.mkdtemp(prefix="bench-env-share-"))
    try:
        with own_backend(root / "home", AIBRO_SPARE_WORKER="0") as backend:
            client = backend.client()
            bare, _ = _gear_up_env(client, [], "no requirements")
            first, view = _gear_up_env(client, requirements, "first machine")
            shutil.rmtree(root / "home" / "state" / "envs")  # the next machine has never seen it
            second, _ = _gear_up_env(client, requirements, "next machine")
            (zipped,) = [a for a in client.artifacts(view.job_id) if a.name.startswith("envs/")]
            archive = root / "home" / "state" / "blobs" / "artifacts" / view.job_id / zipped.name
            started = time.perf_counter()
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(root / "unpacked")
            floor = time.perf_counter() - started
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"requirements: {' '.join(requirements)}; shared zip {zipped['size'] / 1e6:.1f} MB")
    print(f"{'GEARING UP ENV':<34} {'seconds':>8} {'vs first':>9}")
    print(f"{'first machine (pip from the index)':<34} {first:>8.2f} {1.0:>9.2f}")
    print(f"{'next machine (the shared zip)':<34} {second:>8.2f} {second / first:>9.2f}")
    print(f"{'floor: a job with no requirements':<34} {bare:>8.2f} {bare / first:>9.2f}")
    print(f"{'floor: one unpack of that zip':<34} {floor:>8.2f} {floor / first:>9.2f}")


if __name__ == "__main__":
    main()
