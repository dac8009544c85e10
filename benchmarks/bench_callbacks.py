"""The worker's own callbacks against a plain `model.fit`, in one process: what they cost inside training.

bench_foundation's a) and e) compare a remote fit with an in-process one, across two processes and the
embedded backend. This isolates the part the worker adds to `fit` itself: the same model and data are fitted
plain, with the event callback and its epoch pipeline (a checkpoint copy of the model saved every epoch, on a
background thread, into a temporary directory instead of the backend), with the epoch-only TensorBoard callback,
and with both, as the worker runs them. The four run back to back in each round, the order reversed every round,
and each is reported as its median ratio to the plain fit of the same round.

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

MODES = ("plain", "events + checkpoints", "tensorboard", "both (the worker)")


class LocalOutbox:
    """Counts the events the callback queues; the worker's outbox would post them to the backend."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.events = 0

    def put(self, type_: str, data: dict[str, Any], ts: float | None = None) -> int:
        self.events += 1
        return self.events


def fit_once(mode: str, x: Any, y: Any, epochs: int, scratch: Path) -> float:
    """Seconds of one `fit` in this mode, on a fresh model of the same seed."""
    model = build_model(SEED)
    model.fit(x[:256], y[:256], epochs=1, batch_size=BATCH, verbose=0)  # built and traced, as the worker's is
    callbacks: list[keras.callbacks.Callback] = []
    pipeline = None
    if mode in (MODES[1], MODES[3]):
        path = scratch / f"model-{time.monotonic_ns()}.keras"
        model.save(path)
        outbox = LocalOutbox()
        pipeline = EpochPipeline(
            outbox,  # type: ignore[arg-type]
            model,
            shadow_loader(keras, path, True),
            lambda copy, epoch: copy.save(scratch / f"checkpoint-{epoch}.keras"),
        )
        callbacks.append(EventCallback(outbox, pipeline, epochs, len(x)))  # type: ignore[arg-type]
    if mode in (MODES[2], MODES[3]):
        logs = tempfile.mkdtemp(prefix="tb-", dir=scratch)
        callbacks.append(EpochTensorBoard(log_dir=logs, write_graph=False, profile_batch=0))
    started = time.perf_counter()
    model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0, callbacks=callbacks)
    if pipeline is not None:
        pipeline.drain()  # the worker waits for the last checkpoint before it reports the fit done
        pipeline.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20000)
    args = parser.parse_args()
    x, y = make_data(args.rows, seed=1)
    scratch = Path(tempfile.mkdtemp(prefix="aibro-bench-callbacks-"))
    ratios: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    print(f"{args.rows} rows x 64 float32, Dense 256-256-10, batch {BATCH}, {args.epochs} epochs", end="")
    print(f", {os.cpu_count()} CPUs")
    try:
        for rnd in range(args.rounds):
            order = MODES if rnd % 2 == 0 else MODES[::-1]
            took = {mode: fit_once(mode, x, y, args.epochs, scratch) for mode in order}
            for mode in MODES[1:]:
                ratios[mode].append(took[mode] / took[MODES[0]])
            print(f"round {rnd + 1}: " + "   ".join(f"{m} {took[m]:.2f} s" for m in MODES), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{'callbacks':<22} | median / plain | per round")
    for mode, values in ratios.items():
        print(f"{mode:<22} | {statistics.median(values):14.3f} | " + " ".join(f"{r:.3f}" for r in values))


if __name__ == "__main__":
    main()
