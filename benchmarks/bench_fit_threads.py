"""Where a remote fit's CPU goes, thread by thread, beside the same fit in-process.

bench_foundation's a) and e) judge the remote fit by wall time, which on a shared 2-core host swings by more than
the 2 % target from one minute to the next. This counts work instead: the CPU seconds each thread of the worker
spent over the fit's span (the job timeline's `TRAINING` → `RETURNING`), grouped by what the thread does, beside
the threads of this process over an in-process `model.fit` of the same model, data, seed, epochs and batch size,
plus the CPU of the other processes (the backend, this process following the job) over the remote span. The
difference is the work the remote path adds; how much of it can lengthen the fit depends on whether it lands on
the training loop's thread, which the table shows.

    python benchmarks/bench_fit_threads.py              # 3 rounds of ~20 s fits, about 3 minutes
    python benchmarks/bench_fit_threads.py --rounds 5 --seconds 10

Thread names: this process's from `threading`; the worker's from `py-spy dump` (its Python threads; the worker
runs in a PID namespace, so its thread ids are mapped through /proc's NSpid), else from /proc's comm (TensorFlow
names its pools `tf_*`). See benchmarks/README.md.
"""

from __future__ import annotations

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the local-cpu worker runs with CUDA hidden too

import argparse
import gc
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_foundation as bf  # noqa: E402

from aibro_jupyter import config  # noqa: E402
from aibro_jupyter.client import BackendClient  # noqa: E402

GROUPS = {
    "MainThread": "training loop (main thread, with the callbacks' batch and epoch hooks)",
    "aibro-epoch-pipeline": "checkpoints (epoch pipeline)",
    "aibro-outbox": "events to the backend (outbox)",
}
TF_GROUP = "TensorFlow's pools (tf_*)"
OTHER_GROUP = "other threads (tf.data's, TensorBoard writes, native)"


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """{tid: (comm, CPU seconds)} of every thread of `pid` now."""
    out: dict[str, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        if (stat := bf.read_stat(Path(f"/proc/{pid}/task/{tid}/stat"))) is not None:
            out[tid] = stat
    return out


def process_cpu(pid: int) -> float:
    stat = bf.read_stat(Path(f"/proc/{pid}/stat"))
    if stat is None:
        raise SystemExit(f"process {pid} is gone")
    return stat[1]


def python_thread_names(pid: int) -> dict[str, str]:
    """{host tid: Python thread name} of another process, from `py-spy dump` and the tids' NSpid lines."""
    try:
        dump = subprocess.run(
            ["py-spy", "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    inner: dict[str, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            m = re.search(r"NSpid:\s+\d+(?:\s+(\d+))?", Path(f"/proc/{pid}/task/{tid}/status").read_text())
        except OSError:
            continue
        if m:
            inner[m.group(1) or tid] = tid
    return {
        inner[m.group(1)]: m.group(2)
        for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)
        if m.group(1) in inner
    }


def group_of(name: str | None, comm: str) -> str:
    if name is not None:
        return GROUPS.get(name, OTHER_GROUP)
    return TF_GROUP if comm.startswith("tf_") else OTHER_GROUP


class ThreadSampler(threading.Thread):
    """Per-thread CPU of a process every 0.1 s (with the time), and its Python threads' names now and then: the
    threads a fit starts and ends (tf.data's and Keras' own, a few dozen per fit) count too."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, dict[str, tuple[str, float]]]] = []
        self.names: dict[str, str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        last_names = 0.0
        while not self._done.is_set():
            self.samples.append((time.time(), thread_cpu(self.pid)))
            if self.pid == os.getpid():
                self.names.update((str(t.native_id), t.name) for t in threading.enumerate())
            elif time.monotonic() - last_names > 1.0:
                self.names.update(python_thread_names(self.pid))
                last_names = time.monotonic()
            self._done.wait(0.1)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def over(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per group over [start, end]: each thread's last reading by `end` less its reading at
        `start` (0 for a thread born after it)."""
        before = max((s for s in self.samples if s[0] <= start), key=lambda s: s[0], default=(0.0, {}))[1]
        seen: dict[str, tuple[str, float]] = {}
        for when, reading in self.samples:
            if start < when <= end + 0.1:
                seen.update(reading)
        groups: dict[str, float] = defaultdict(float)
        seen.pop(str(self.native_id), None)  # the sampler itself, when it samples its own process
        for tid, (comm, cpu) in seen.items():
            groups[group_of(self.names.get(tid), comm)] += cpu - before.get(tid, (comm, 0.0))[1]
        return groups


def local_round(x: np.ndarray, y: np.ndarray, epochs: int) -> tuple[float, dict[str, float]]:
    """Wall seconds of an in-process fit and its CPU per group of this process's threads, over `fit` alone."""
    model = bf.build_model(bf.SEED)
    gc.collect()  # as bench_foundation's in-process fit: earlier fits' garbage stays out of this one
    sampler = ThreadSampler(os.getpid())
    sampler.start()
    time.sleep(0.2)
    begin, started = time.time(), time.perf_counter()
    model.fit(x, y, epochs=epochs, batch_size=bf.BATCH, verbose=0)
    wall, end = time.perf_counter() - started, time.time()
    time.sleep(0.2)
    sampler.stop()
    groups = sampler.over(begin, end)
    return wall, groups


def worker_pid(home: Path) -> int:
    """The worker that ran the warm-up job: of this home's Python worker processes (the spare beside it too), the
    one with the most threads (TensorFlow starts its pools at the first op)."""
    workers = [
        pid for pid, argv in bf.our_processes(home).items() if any(a.startswith(b"aibro_backend.worker") for a in argv)
    ]
    if not workers:
        raise SystemExit("no worker process of this benchmark was found")
    return max(workers, key=lambda pid: len(os.listdir(f"/proc/{pid}/task")))


def backend_pid(home: Path) -> int:
    """The embedded backend of this benchmark's home (`python -m aibro_backend --home HOME`)."""
    for pid, argv in bf.our_processes(home).items():
        if b"aibro_backend" in argv:
            return pid
    raise SystemExit("the embedded backend's process was not found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="the in-process fit's length to calibrate to")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="aibro-bench-threads-"))
    for var in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN"):
        os.environ.pop(var, None)
    os.environ["AIBRO_HOME"] = str(home)
    try:
        target = config.resolve()
        client = BackendClient(target.url, target.token)
        client.health()
        bf.warm_up(client)
        x, y = bf.make_data(bf.N_FIT, seed=1)
        probe = bf.local_fit(x, y, 3, bf.BATCH)
        epochs = max(2, round(args.seconds / min(probe["epoch_s"][1:])))
        worker = worker_pid(home)
        backend = backend_pid(home)
        print(f"worker pid {worker}, backend pid {backend}")
        print(f"{bf.N_FIT} rows, Dense 256-256-10, batch {bf.BATCH}, {epochs} epochs, {os.cpu_count()} CPUs")
        local: list[dict[str, float]] = []
        remote: list[dict[str, float]] = []
        backend_cpu: list[float] = []
        ratios: list[float] = []
        for rnd in range(args.rounds):
            sampler = ThreadSampler(worker)
            sampler.start()
            backend0 = process_cpu(backend)
            fit = bf.remote_fit(client, x, y, epochs, bf.BATCH)
            backend_cpu.append(process_cpu(backend) - backend0)  # the whole job's, transfers too: an upper bound
            sampler.stop()
            job = client.job(fit["job_id"])
            span = (bf.ts_of(job, "TRAINING", "TRAINING"), bf.ts_of(job, "RETURNING"))
            remote.append(sampler.over(*span))
            local_s, groups = local_round(x, y, epochs)
            local.append(groups)
            ratios.append(fit["fit_s"] / local_s)
            print(
                f"round {rnd + 1}: remote fit {fit['fit_s']:.2f} s, CPU {sum(remote[-1].values()):.2f} s | "
                f"in-process fit {local_s:.2f} s, CPU {sum(groups.values()):.2f} s | wall ratio {ratios[-1]:.3f}",
                flush=True,
            )
    finally:
        config.stop_embedded()
        bf.kill_workers(home)
        shutil.rmtree(home, ignore_errors=True)
    order = [*GROUPS.values(), TF_GROUP, OTHER_GROUP]
    width = max(len(g) for g in order) + 2
    print(f"\nCPU s per fit, median of {args.rounds} rounds")
    print(f"{'threads':<{width}} | in-process | remote worker | remote - in-process")
    for group in order:
        lo = statistics.median(r.get(group, 0.0) for r in local)
        re_ = statistics.median(r.get(group, 0.0) for r in remote)
        print(f"{group:<{width}} | {lo:10.2f} | {re_:13.2f} | {re_ - lo:+19.2f}")
    lo_total = statistics.median(sum(r.values()) for r in local)
    re_total = statistics.median(sum(r.values()) for r in remote)
    print(f"{'all threads':<{width}} | {lo_total:10.2f} | {re_total:13.2f} | {re_total - lo_total:+19.2f}")
    backend_s = statistics.median(backend_cpu)
    print(f"{'the backend process (whole job)':<{width}} | {'-':>10} | {backend_s:13.2f} | {backend_s:+19.2f}")
    extra = re_total - lo_total + backend_s
    print(f"\nextra CPU of the remote path per fit: {extra:.2f} s = {extra / lo_total:.1%} of the in-process fit's CPU")
    print(f"remote fit / in-process fit, wall, median of {len(ratios)} rounds: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
