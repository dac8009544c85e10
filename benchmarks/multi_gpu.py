"""The multi-device path on real GPUs (issue 23 item 6): the same job on `local-gpu-all` (every GPU of this host,
MirroredStrategy on the worker) and on `local-gpu0`, beside the same fit in this process under MirroredStrategy.

    python benchmarks/multi_gpu.py [--epochs 3] [--batch 256]

Prints the worker's placement line (devices and batch per device), each run's seconds per epoch and final loss,
and the ratio of the remote loss to the in-process one. On a host with fewer than 2 GPUs it says so and exits 2:
the suite proves the same path on 2 logical CPU devices (tests/test_fit_parity.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from aibro_jupyter.fitrequest import FitRequest


def data(n: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 32, 32, 3)).astype("float32")
    return x, (x.mean(axis=(1, 2, 3)) > 0).astype("int32")


def build(strategy: object | None = None) -> object:
    import keras

    def make() -> object:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(2, activation="softmax"),
            ]
        )
        model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    if strategy is None:
        return make()
    with strategy.scope():  # type: ignore[attr-defined]
        return make()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("AIBRO_HOME", tempfile.mkdtemp(prefix="aibro-multigpu-"))
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    print(f"GPUs here: {len(gpus)}")
    if len(gpus) < 2:
        print("fewer than 2 GPUs: nothing to compare (tests/test_fit_parity.py proves the path on 2 CPU devices)")
        return 2
    from aibro_jupyter import Training
    from aibro_jupyter.progress import worker_note

    x, y = data()
    rows = []
    start = time.perf_counter()
    local = build(tf.distribute.MirroredStrategy()).fit(x, y, epochs=args.epochs, batch_size=args.batch, verbose=0)
    rows.append(("in-process MirroredStrategy", (time.perf_counter() - start) / args.epochs, local.history["loss"][-1]))
    trainer = Training()
    for machine in ("local-gpu-all", "local-gpu0"):
        notes: list[str] = []
        job = trainer.submit(FitRequest(build(), x, y, machine_ids=machine, epochs=args.epochs, batch_size=args.batch))
        view = trainer.watch(job.job_id, [lambda _v, ev, notes=notes: notes.append(worker_note(ev) or "")])
        _, history = trainer.collect(view)
        seconds = [e["seconds"] for e in view.history.values()]
        print(f"{machine}: {' | '.join(n for n in notes if 'MirroredStrategy' in n) or 'one device'}")
        rows.append((f"remote {machine}", float(np.median(seconds)), history.history["loss"][-1]))
    print(f"\n{'run':34} {'s/epoch':>8} {'final loss':>11} {'loss / in-process':>18}")
    for name, sec, loss in rows:
        print(f"{name:34} {sec:8.2f} {loss:11.4f} {loss / rows[0][2]:18.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
