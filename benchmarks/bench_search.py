"""Hyperparameter search (issue 27 item 7): one 8-trial RandomSearch run three ways on this host, side by side.

* local: KerasTuner's own `tuner.search` in this process (the ceiling: nothing travels, one trial at a time);
* remote, `parallel=1`: `Training.online_search` on a fresh embedded backend, trials as jobs on `local-cpu` with a
  cool-down, so each trial after the first finds a warm machine;
* remote, `parallel=2`: the same with two trials at once (local-cpu's capacity is the host's CPU count).

The same build function (tests/searchmodels.py), data, seed, epochs and batch size each time. Per trial on a warm
machine: the remote wall time per trial minus the local one (gear-up, upload, events and the model coming back),
and the median of each trial job's own start-to-training delay from its timeline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64)).astype("float32")
    w = rng.normal(size=(64, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def tuner(directory: Path, name: str, trials: int):  # noqa: ANN201 - a keras_tuner.RandomSearch
    import keras_tuner as kt
    from searchmodels import build_model

    return kt.RandomSearch(
        build_model, objective="val_accuracy", max_trials=trials, seed=11, directory=str(directory), project_name=name
    )


def start_delay(job: dict) -> float:
    """Seconds from the job's creation to its TRAINING · TRAINING (machine, gear-up, data, model)."""
    entered = next(e["ts"] for e in job["timeline"] if e["status"] == "TRAINING" and e["substatus"] == "TRAINING")
    return float(entered) - float(job["created"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="aibro-bench-search-"))
    for var in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN"):
        os.environ.pop(var, None)
    os.environ.update(AIBRO_HOME=str(root / "home"))
    x, y = data(args.samples, 1)
    xv, yv = data(args.samples // 4, 2)
    fit = {"epochs": args.epochs, "batch_size": 64, "validation_data": (xv, yv)}
    print(
        f"aibro search benchmark: {args.trials}-trial RandomSearch, {args.samples} samples, {args.epochs} epochs, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    rows: dict[str, float] = {}
    delays: dict[str, float] = {}
    try:
        t = time.perf_counter()
        local = tuner(root, "local", args.trials)
        local.search(x, y, verbose=0, **fit)
        rows["local KerasTuner (in this process)"] = time.perf_counter() - t
        print(f"local: {rows['local KerasTuner (in this process)']:.1f} s", flush=True)

        from aibro_jupyter import Training
        from aibro_jupyter.config import stop_embedded

        try:
            for parallel in (1, 2):
                t = time.perf_counter()
                study_id, _best = Training.online_search(
                    tuner(root, f"remote{parallel}", args.trials),
                    x,
                    y,
                    machine_ids="local-cpu",
                    parallel=parallel,
                    verbose=False,
                    **fit,
                )
                key = f"remote, parallel={parallel}"
                rows[key] = time.perf_counter() - t
                client = Training().client
                study = client.t.json("GET", f"/studies/{study_id}")
                assert study["status"] == "COMPLETED", study
                delays[key] = statistics.median(start_delay(client.job(tr["job_id"])) for tr in study["trials"])
                print(f"{key}: {rows[key]:.1f} s", flush=True)
        finally:
            stop_embedded()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows["local KerasTuner (in this process)"]
    print()
    width = max(len(k) for k in rows) + 2
    print(f"{'way':<{width}} | {'wall s':>7} | {'/ local':>7} | {'per trial s':>11} | {'job start s (median)':>20}")
    print("-" * (width + 58))
    for key, took in rows.items():
        per = took / args.trials
        delay = f"{delays[key]:.2f}" if key in delays else "-"
        print(f"{key:<{width}} | {took:>7.1f} | {took / base:>7.2f} | {per:>11.2f} | {delay:>20}")
    overhead = (rows["remote, parallel=1"] - base) / args.trials
    print(f"\noverhead per trial, remote parallel=1 vs local: {overhead:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
