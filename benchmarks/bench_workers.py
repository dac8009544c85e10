"""One fit on two workers against one (issue 37 item 6): steps per second, scaling efficiency and the time the
workers spend between steps, side by side in one run, with the single-process fit as the ceiling's base.

Each run is `aibro_backend/worker/gangfit.py` as the agent starts it (Keras on JAX, gloo), on synthetic images:
  * one process, no distribution, pinned to one core: the baseline (what one worker machine of one core does);
  * a gang of 1 pinned to one core: the gang's own cost (the distribution API, the coordination service);
  * a gang of 2, one core each, the same global batch: each computes half of every batch, then they sum.
Steps/s are from member 0's epoch lines, the median of the epochs after the first (which compiles). Scaling
efficiency = (steps/s of 2) / (2 x steps/s of the baseline): 1.0 is the ceiling (target >= 0.8). The time between
steps is estimated as (step time of 2) - (step time of the baseline) / 2: what is not the halved compute (the
all-reduce, and the two waiting for each other).

`--sweep` repeats the 1-vs-2 comparison over smaller models (the conv widths divided by 2, 4, ...) down to the
one where two workers no longer gain: the point where communication dominates. `--gpus 2` is for a machine with
two GPUs (one per member, CUDA_VISIBLE_DEVICES; needs jax[cuda]): the same table. Not in CI: a benchmark measures,
it asserts nothing; run it on a quiet machine.

    python benchmarks/bench_workers.py [--epochs 3] [--rows 2048] [--batch 64] [--sweep] [--gpus 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from aibro_backend.worker import gangfit
from aibro_backend.worker.gangfit import GangSpec

BUILD = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
import keras
width, out = int(sys.argv[1]), sys.argv[2]
keras.utils.set_random_seed(0)
m = keras.Sequential([
    keras.Input((32, 32, 3)),
    keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
    keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
    keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(4 * width, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
m.save(out)
print(m.count_params())
"""

BASELINE = """
import json, os, sys, time
os.sched_setaffinity(0, {0})
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np, keras
model_path, x_path, y_path, batch, epochs = sys.argv[1:]
model = keras.saving.load_model(model_path)
x, y = np.load(x_path), np.load(y_path)
class T(keras.callbacks.Callback):
    def on_epoch_begin(self, e, logs=None): self.t = time.monotonic()
    def on_epoch_end(self, e, logs=None): print(json.dumps({"seconds": time.monotonic() - self.t}), flush=True)
model.fit(x, y, batch_size=int(batch), epochs=int(epochs), shuffle=False, verbose=0, callbacks=[T()])
"""


def build(folder: Path, width: int) -> tuple[Path, int]:
    path = folder / f"conv-{width}.keras"
    run = subprocess.run([sys.executable, "-c", BUILD, str(width), str(path)], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-2000:])
    return path, int(run.stdout.strip().splitlines()[-1])


def steps_per_s(epoch_seconds: list[float], steps: int) -> float:
    later = epoch_seconds[1:] or epoch_seconds
    return steps / statistics.median(later)


def baseline(model: Path, x: Path, y: Path, batch: int, epochs: int) -> list[float]:
    run = subprocess.run(
        [sys.executable, "-c", BASELINE, str(model), str(x), str(y), str(batch), str(epochs)],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise SystemExit(run.stderr[-2000:])
    return [json.loads(line)["seconds"] for line in run.stdout.splitlines() if line.startswith("{")]


def gang(spec: GangSpec, folder: Path, workers: int, gpus: int) -> list[float]:
    """Member 0's epoch seconds for a gang of `workers`, one core each (or one GPU each with `gpus`)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"gang{workers}-", dir=folder))
    progress = run_dir / "progress.jsonl"
    spec = replace(spec, num_processes=workers, progress=str(progress), out=str(run_dir / "out.keras"))
    for _ in range(5):
        port = gangfit.free_port()
        spec = replace(spec, coordinator=f"127.0.0.1:{port}", bind=f"127.0.0.1:{port}")
        cpus = [(i % (os.cpu_count() or 1),) for i in range(workers)]
        envs = None
        if gpus:
            envs = [{**os.environ, "CUDA_VISIBLE_DEVICES": str(i), "JAX_PLATFORMS": "cuda"} for i in range(workers)]
        procs = []
        for i in range(workers):
            path = run_dir / f"member-{i}.json"
            spec.member(i, cpus=None if gpus else cpus[i]).dump(path)
            with open(run_dir / f"member-{i}.log", "wb") as log:
                env = {**(envs[i] if envs else os.environ), "KERAS_BACKEND": "jax"}
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "aibro_backend.worker.gangfit", str(path)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = gangfit.wait_all(procs, timeout_s=3600)
        if codes[0] == gangfit.PORT_TAKEN_EXIT:
            continue
        if any(codes):
            raise SystemExit(f"gang of {workers} failed {codes}: {(run_dir / 'member-0.log').read_text()[-2000:]}")
        lines = [json.loads(line) for line in progress.read_text().splitlines()]
        return [line["seconds"] for line in lines if line["kind"] == "epoch"]
    raise SystemExit("no free port for the coordinator")


def compare(folder: Path, width: int, args: argparse.Namespace, x: Path, y: Path) -> dict[str, float]:
    model, params = build(folder, width)
    steps = args.rows // args.batch
    spec = GangSpec(
        coordinator="",
        num_processes=1,
        process_id=0,
        model=str(model),
        x=str(x),
        y=str(y),
        batch_size=args.batch,
        epochs=args.epochs,
        out="",
        history=str(folder / "history.json"),
    )
    t0 = time.monotonic()
    base = steps_per_s(baseline(model, x, y, args.batch, args.epochs), steps)
    one = steps_per_s(gang(spec, folder, 1, 0), steps)
    two = steps_per_s(gang(spec, folder, 2, args.gpus), steps)
    between_ms = (1 / two - 0.5 / base) * 1000
    return {
        "width": width,
        "params": params,
        "baseline": base,
        "one": one,
        "two": two,
        "efficiency": two / (2 * base),
        "between_ms": between_ms,
        "step_ms": 1000 / base,
        "seconds": time.monotonic() - t0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=64, help="the first conv layers' filters (64: about 2.2 M params)")
    p.add_argument("--sweep", action="store_true", help="also smaller models, down to where two workers lose")
    p.add_argument("--gpus", type=int, default=0, help="2: one GPU per member (a GPU machine; needs jax[cuda])")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    rng = np.random.default_rng(0)
    x, y = folder / "x.npy", folder / "y.npy"
    np.save(x, rng.normal(size=(args.rows, 32, 32, 3)).astype("float32"))
    np.save(y, rng.integers(0, 10, size=args.rows).astype("int32"))
    print(f"cores {os.cpu_count()}, {args.rows} rows of 32x32x3, global batch {args.batch}, {args.epochs} epochs")
    rows = [compare(folder, args.width, args, x, y)]
    width = args.width
    while args.sweep and width > 1 and rows[-1]["two"] > rows[-1]["baseline"]:
        width //= 2
        rows.append(compare(folder, width, args, x, y))
    header = (
        f"{'conv width':>10} {'params':>10} {'1 process steps/s':>18} {'gang of 1':>10} {'gang of 2':>10} "
        f"{'2 / 1':>7} {'efficiency':>10} {'target':>7} {'ceiling':>7} {'step ms':>8} {'between ms':>10}"
    )
    print(header)
    for r in rows:
        ok = "yes" if r["efficiency"] >= 0.8 else "NO"
        print(
            f"{r['width']:>10} {r['params']:>10} {r['baseline']:>18.2f} {r['one']:>10.2f} {r['two']:>10.2f} "
            f"{r['two'] / r['baseline']:>7.3f} {r['efficiency']:>10.3f} {'>= 0.8':>7} {1.0:>7.3f} "
            f"{r['step_ms']:>8.1f} {r['between_ms']:>10.1f}   ({ok}; {r['seconds']:.0f} s)"
        )
    if args.sweep:
        gaining = [r for r in rows if r["two"] > r["baseline"]]
        smallest = min(gaining, key=lambda r: r["params"]) if gaining else None
        print(
            "smallest model that still gains from a second worker: "
            + (f"width {smallest['width']}, {smallest['params']} params" if smallest else "none of these")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
