"""The worker's own callbacks against a plain `model.fit`, in one process: what they cost inside training.

bench_foundation's a) and e) compare a remote fit with an in-process one, across two processes and the
embedded backend. This isolates the part the worker adds to `fit` itself: the same model and data are fitted
plain, with the event callback and its epoch pipeline (a checkpoint every epoch, made on a background thread and
copied into a temporary directory instead of uploaded to the backend), the same with every checkpoint saved by
Keras (the pipeline's `direct=False`: what the worker did before it wrote checkpoints straight from the weights
snapshot), with the epoch-only TensorBoard callback, and with events + checkpoints + TensorBoard, as the worker
runs them. The five run back to back in each round, the order reversed every round, and each is reported as its
median ratio to the plain fit of the same round.

    python benchmarks/bench_callbacks.py              # 4 rounds of 8 epochs over 20,000 rows (~0.7-1 s epochs)
    python benchmarks/bench_callbacks.py --rounds 6 --rows 50000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # as the local-cpu worker runs

import keras  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import BATCH, SEED, build_model, make_data  # noqa: E402

from aibro_backend.worker.callbacks import EpochTensorBoard, EventCallback  # noqa: E402
from aibro_backend.worker.pipeline import EpochPipeline, shadow_loader  # noqa: E402

MODES = ("plain", "events + checkpoints", "events + Keras-saved checkpoints", "tensorboard", "both (the worker)")
WITH_EVENTS = (MODES[1], MODES[2], MODES[4])
WITH_TENSORBOARD = (MODES[3], MODES[4])


class LocalOutbox:
    """Counts the events the callback queues; the worker's outbox would post them to the backend."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.events = 0

    def put(self, type_: str, data: dict[str, Any], ts: float | None = None) -> int:
        self.events += 1
        return self.events


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) one thread of this process has used, from /proc."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class AfterFirstEpoch(keras.callbacks.Callback):
    """Reads the pipeline thread's CPU when the first epoch ends: by then the pipeline has loaded its copy of the
    model and learned the checkpoint layout (the event callback waits for that at its first epoch end)."""

    def __init__(self, native_id: int) -> None:
        super().__init__()
        self.native_id = native_id
        self.cpu_s = 0.0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == 0:
            self.cpu_s = thread_cpu_s(self.native_id)


def fit_once(mode: str, x: Any, y: Any, epochs: int, scratch: Path) -> tuple[float, float, float]:
    """Wall seconds of one `fit` in this mode (on a fresh model of the same seed), the process's CPU seconds
    in it (every thread: training, TensorFlow's pool, the pipeline), and the epoch pipeline thread's CPU seconds per
    epoch after the first (its checkpoints, less its set-up: loading its copy of the model, learning the layout)."""
    model = build_model(SEED)
    model.fit(x[:256], y[:256], epochs=1, batch_size=BATCH, verbose=0)  # built and traced, as the worker's is
    callbacks: list[keras.callbacks.Callback] = []
    pipeline = None
    if mode in WITH_EVENTS:
        path = scratch / f"model-{time.monotonic_ns()}.keras"
        model.save(path)
        outbox = LocalOutbox()
        work = Path(tempfile.mkdtemp(prefix="checkpoints-", dir=scratch))
        pipeline = EpochPipeline(
            outbox,  # type: ignore[arg-type]
            model,
            shadow_loader(keras, path, True),
            lambda saved, epoch: shutil.copy(saved, scratch / f"checkpoint-{epoch}.keras"),  # the "upload"
            work,
            direct=mode != MODES[2],
        )
        callbacks.append(EventCallback(outbox, pipeline, epochs, len(x)))  # type: ignore[arg-type]
        first = AfterFirstEpoch(pipeline._thread.native_id)  # type: ignore[arg-type]
        callbacks.append(first)
    if mode in WITH_TENSORBOARD:
        logs = tempfile.mkdtemp(prefix="tb-", dir=scratch)
        callbacks.append(EpochTensorBoard(log_dir=logs, write_graph=False, profile_batch=0))
    started, cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0, callbacks=callbacks)
    pipeline_cpu = 0.0
    if pipeline is not None:
        pipeline.drain()  # the worker waits for the last checkpoint before it reports the fit done
        pipeline_cpu = (thread_cpu_s(pipeline._thread.native_id) - first.cpu_s) / (epochs - 1)  # type: ignore[arg-type]
        pipeline.close()
    return time.perf_counter() - started, time.process_time() - cpu, pipeline_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20000)
    args = parser.parse_args()
    x, y = make_data(args.rows, seed=1)
    scratch = Path(tempfile.mkdtemp(prefix="aibro-bench-callbacks-"))
    ratios: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    pipeline_ms: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    print(f"{args.rows} rows x 64 float32, Dense 256-256-10, batch {BATCH}, {args.epochs} epochs", end="")
    print(f", {os.cpu_count()} CPUs")
    try:
        for rnd in range(args.rounds):
            order = MODES if rnd % 2 == 0 else MODES[::-1]
            took = {mode: fit_once(mode, x, y, args.epochs, scratch) for mode in order}
            for mode in MODES[1:]:
                ratios[mode].append(took[mode][0] / took[MODES[0]][0])
                cpu_ratios[mode].append(took[mode][1] / took[MODES[0]][1])
                pipeline_ms[mode].append(took[mode][2] * 1000)
            print(f"round {rnd + 1}: " + "   ".join(f"{m} {took[m][0]:.2f} s" for m in MODES), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    width = max(len(m) for m in MODES)
    print(f"\n{'callbacks':<{width}} | wall / plain | CPU / plain | pipeline CPU ms/checkpoint | wall per round")
    for mode, values in ratios.items():
        print(
            f"{mode:<{width}} | {statistics.median(values):12.3f} | {statistics.median(cpu_ratios[mode]):11.3f} | "
            f"{statistics.median(pipeline_ms[mode]) if mode in WITH_EVENTS else 0:26.1f} | "
            + " ".join(f"{r:.3f}" for r in values)
        )
    print("(medians over the rounds; each ratio against the plain fit of the same round)")


if __name__ == "__main__":
    main()
