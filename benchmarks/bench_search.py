"""Hyperparameter search (issue 27 item 7, issue 40): one 8-trial RandomSearch run three ways on this host, side by
side, with where each trial job's start goes and a warm plain fit job's start beside it.

* local: KerasTuner's own `tuner.search` in this process (the ceiling: nothing travels, one trial at a time);
* remote, `parallel=1`: `Training.online_search` on a fresh embedded backend, trials as jobs on `local-cpu` with no
  cool-down of the user's (a study keeps its trial's worker warm for its next trial: tuning/handover.py);
* remote, `parallel=2`: the same with two trials at once (local-cpu's capacity is the host's CPU count);
* a warm fit job: the same model as a plain `online_fit` on a worker kept warm by a cool-down, five times.

The same build function (tests/searchmodels.py), data, seed, epochs and batch size each time. Each trial job's
timeline, from its events and its study's (issue 40): the handover (the previous trial's job in the slot ended →
this trial's job made; the oracle's round trips in it), the assignment (made → placed on a worker), the pickup
(placed → the worker gears up), the gear-up, the data, the model built from the build function and loaded
(the worker's `timings` log event), and the start (made → TRAINING · TRAINING).
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
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

STAGES = ("handover", "oracle", "assignment", "pickup", "gear-up", "data", "build", "load", "start")


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


def job_timeline(events: list[dict[str, Any]], created: float) -> dict[str, float]:
    """Seconds of one job's start, by stage, from its event log."""
    from aibro_core import vocabulary as v

    at: dict[str, float] = {}
    out: dict[str, float] = {}
    for e in events:
        d = e["data"]
        if e["type"] == v.EV_STATUS:
            at.setdefault(d["substatus"], e["ts"])
        elif e["type"] == v.EV_LOG and "timings" in d:
            out.update({k: float(s) for k, s in d["timings"].items()})
    placed, gearing = at.get(v.CONNECTING_SERVER), at.get(v.GEARING_UP_ENV)
    sending, training = at.get(v.SENDING_MODEL_DATA), at.get(v.SUB_TRAINING)
    if placed is not None:
        out["assignment"] = placed - created
    if placed is not None and gearing is not None:
        out["pickup"] = gearing - placed
    if gearing is not None and sending is not None:
        out["gear-up"] = sending - gearing
    if training is not None:
        out["start"] = training - created
    return out


def trial_timelines(client: Any, study_id: str) -> list[dict[str, float]]:
    """Each trial job's timeline, with the handover from the previous trial's job in its slot and the oracle's
    round trips (ending that trial, handing out this one) from the study's own log."""
    from aibro_core import vocabulary as v
    from aibro_core.models import StudyEventData

    said = [StudyEventData.model_validate(e["data"]) for e in client.study_events(study_id)["events"]]
    slot_of = {e.trial_id: e.slot for e in said if e.event == v.StudyEvent.TRIAL_STARTED}
    ended_oracle = {e.trial_id: e.oracle_s or 0.0 for e in said if e.event == v.StudyEvent.TRIAL_ENDED}
    last_end: dict[str | None, tuple[float, str]] = {}  # slot -> (when its last trial's job ended, that trial)
    out = []
    for e in said:
        if e.event != v.StudyEvent.TRIAL_STARTED or e.job_id is None:
            continue
        job = client.job(e.job_id)
        row = job_timeline(client.events(e.job_id)["events"], job.created)
        before = last_end.get(e.slot)
        if before is not None:
            row["handover"] = job.created - before[0]
            row["oracle"] = ended_oracle.get(before[1], 0.0) + (e.oracle_s or 0.0)
        ended = [t.ts for t in job.timeline if t.status in v.JOB_FINAL and t.ts is not None]
        if ended:
            last_end[slot_of.get(e.trial_id)] = (ended[-1], str(e.trial_id))
        out.append(row)
    return out


def warm_fit_starts(x: np.ndarray, y: np.ndarray, n: int) -> list[dict[str, float]]:
    """The start of `n` plain fit jobs of the same model on a worker a first fit left warm (a cool-down)."""
    import keras_tuner as kt
    from searchmodels import build_model

    from aibro_jupyter import Training

    client = Training().client
    out = []
    for i in range(n + 1):
        model = build_model(kt.HyperParameters())
        job_id, _model, _history = Training.online_fit(
            model, x, y, machine_ids="local-cpu", epochs=1, batch_size=64, cool_down_period_s=120, verbose=False
        )
        if i:  # the first one warms the worker
            out.append(job_timeline(client.events(job_id)["events"], client.job(job_id).created))
    return out


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.3f} / {p95:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--fits", type=int, default=5, help="warm plain fit jobs to measure")
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
    timelines: dict[str, list[dict[str, float]]] = {}
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
                study = client.study(study_id)
                assert study.status == "COMPLETED", study
                timelines[key] = trial_timelines(client, study_id)
                print(f"{key}: {rows[key]:.1f} s", flush=True)
            timelines["warm fit job"] = warm_fit_starts(x, y, args.fits)
        finally:
            stop_embedded()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows["local KerasTuner (in this process)"]
    print()
    width = max(len(k) for k in rows) + 2
    print(f"{'way':<{width}} | {'wall s':>7} | {'/ local':>7} | {'per trial s':>11}")
    print("-" * (width + 34))
    for key, took in rows.items():
        print(f"{key:<{width}} | {took:>7.1f} | {took / base:>7.2f} | {took / args.trials:>11.2f}")
    overhead = (rows["remote, parallel=1"] - base) / args.trials
    print(f"\noverhead per trial, remote parallel=1 vs local: {overhead:.2f} s")
    print("\nwhere a job's start goes, seconds, median / p95 (handover: the slot's previous trial ended -> this job)")
    print(f"{'stage':<11} | " + " | ".join(f"{k:>20}" for k in timelines))
    for stage in STAGES:
        cells = [spread([r[stage] for r in rs if stage in r]) for rs in timelines.values()]
        print(f"{stage:<11} | " + " | ".join(f"{c:>20}" for c in cells))
    fit_start = statistics.median(r["start"] for r in timelines["warm fit job"])
    for key in ("remote, parallel=1", "remote, parallel=2"):
        starts = [r["start"] + r.get("handover", 0.0) for r in timelines[key] if "start" in r]
        if starts and fit_start > 0:
            print(
                f"{key}: a trial's start from its predecessor's end {spread(starts)} s (median / p95), "
                f"{statistics.median(starts) / fit_start:.1f} x a warm fit job's {fit_start:.3f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
