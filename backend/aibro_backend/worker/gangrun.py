"""The agent's side of a job fit by a gang of processes on this machine (`workers` > 1, issue 37).

The agent keeps its TensorFlow process and its model: the members (worker/gangfit.py, Keras on JAX, one process
each with a share of this machine's cores) train the same file; member 0 writes each epoch's weights and optimizer
state (an .npz) and a line per epoch and a few per second of batches. The agent puts each epoch's values into its
own model and hands that epoch to the same `EpochPipeline` a one-process fit uses, so the checkpoint, the epoch event
and the model that goes back are made exactly as they are for any job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from aibro_core import vocabulary as v

from . import gangfit
from .callbacks import clean_logs
from .pipeline import EpochPipeline

FIT_ARGS = {
    "epochs",
    "batch_size",
    "shuffle",
    "initial_epoch",
    "verbose",
    "validation_split",
    "validation_batch_size",
}
"""What a gang's fit takes from the user's arguments; the kernel refuses the others before anything is uploaded."""
FOLLOW_S = 0.05
PORT_ATTEMPTS = 5


MAX_RESTARTS = 3


class GangRefused(ValueError):
    """What this gang cannot run, in words that name the fix."""


class GangLost(RuntimeError):
    """A member ended by a signal (killed, or aborted when a member stopped answering): the gang can start again."""


def require_jax(workers: int) -> None:
    """A worker without the JAX packages says so at gear-up, naming what to install."""
    if importlib.util.find_spec("jax") is None:
        raise GangRefused(
            f"this job asks for {workers} workers, which train with Keras on JAX, and this machine's Python has no "
            "jax: install the worker extra (pip install 'aibro-backend[workers]', which brings jax[cpu]) or submit "
            "with --workers 1"
        )


def arrays_of(x: Any, y: Any, sample_weight: Any, what: str = "") -> dict[str, np.ndarray]:
    """The fit's data as plain arrays with one first dimension (what each member memory-maps its rows from)."""
    found: dict[str, np.ndarray] = {}
    for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if value is None:
            continue
        if not isinstance(value, np.ndarray):
            raise GangRefused(
                f"--workers takes NumPy arrays for x, y and sample_weight; this job's {what}{name} is "
                f"{type(value).__name__}: pass one array each, or submit with --workers 1"
            )
        found[name] = value
    if "x" not in found:
        raise GangRefused("--workers needs the training inputs x as a NumPy array")
    return found


def dataset_arrays(ds: Any, what: str) -> tuple[dict[str, np.ndarray], int]:
    """A finite tf.data dataset of (x, y[, sample_weight]) batches as arrays in its order, and its batch size: the
    gang then splits every one of its batches as a one-process fit over the dataset takes them."""
    parts: list[list[np.ndarray]] = []
    sizes: list[int] = []
    for element in ds.as_numpy_iterator():
        tensors = element if isinstance(element, tuple) else (element,)
        if not parts:
            parts = [[] for _ in tensors]
        for into, tensor in zip(parts, tensors):
            into.append(np.asarray(tensor))
        sizes.append(len(tensors[0]))
    if not sizes:
        raise GangRefused(f"the {what}dataset is empty")
    if any(size != sizes[0] for size in sizes[:-1]) or sizes[-1] > sizes[0]:
        raise GangRefused(
            f"the {what}dataset's batches differ in size ({sorted(set(sizes))[:5]}): --workers splits each batch "
            "evenly; batch it once, at the end of its pipeline"
        )
    names = ("x", "y", "sample_weight")
    return {names[i]: np.concatenate(chunks) for i, chunks in enumerate(parts)}, sizes[0]


@dataclass(frozen=True)
class GangData:
    """What the gang trains on, as arrays: the rows, the global batch, and the validation rows and batch."""

    arrays: dict[str, np.ndarray]
    batch_size: int
    shuffle: bool
    validation: dict[str, np.ndarray]
    validation_batch_size: int | None


def gang_data(x: Any, y: Any, sample_weight: Any, validation_data: Any, fit: dict[str, Any]) -> GangData:
    """The fit's data as the gang takes it: arrays as given, a dataset's batches as arrays in their order (Keras does
    not shuffle a dataset), the validation rows from `validation_data` or the last `validation_split` of the rows
    (cut where Keras cuts them, before any shuffling)."""
    batch, shuffle = int(fit.get("batch_size") or 32), bool(fit.get("shuffle", True))
    if hasattr(x, "element_spec"):
        arrays, batch = dataset_arrays(x, "")
        shuffle = False
    else:
        arrays = arrays_of(x, y, sample_weight)
    val_batch = fit.get("validation_batch_size")
    validation: dict[str, np.ndarray] = {}
    if isinstance(validation_data, tuple) and len(validation_data) == 1:
        validation_data = validation_data[0]  # a dataset travels as the only part of the validation data
    if hasattr(validation_data, "element_spec"):
        validation, val_batch = dataset_arrays(validation_data, "validation ")
    elif validation_data is not None:
        parts = list(validation_data) + [None] * (3 - len(validation_data))
        validation = arrays_of(*parts[:3], what="validation ")
    elif fit.get("validation_split"):
        at = int(np.floor(len(arrays["x"]) * (1.0 - float(fit["validation_split"]))))
        arrays, validation = {k: a[:at] for k, a in arrays.items()}, {k: a[at:] for k, a in arrays.items()}
    return GangData(arrays, batch, shuffle, validation, val_batch)


@dataclass(frozen=True)
class Epoch:
    """One epoch as member 0 reported it."""

    epoch: int
    logs: dict[str, float]
    seconds: float
    snapshot: Path


@dataclass(frozen=True)
class GangJob:
    """What the agent hands a gang: the job's file, data, fit and where to keep the members' files."""

    model_path: Path
    arrays: dict[str, np.ndarray]
    workers: int
    batch_size: int
    epochs: int
    initial_epoch: int
    shuffle: bool
    seed: int
    folder: Path
    objects: dict[str, Any]
    safe_mode: bool
    validation: dict[str, np.ndarray] | None = None
    validation_batch_size: int | None = None
    callbacks: tuple[dict[str, Any], ...] = ()


def cpu_shares(workers: int, cpus: set[int] | None = None) -> list[tuple[int, ...] | None]:
    """Each member's cores: this process' cores split in equal runs; where there are fewer cores than members,
    every member may use all of them (None)."""
    mine = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(mine) < workers:
        return [None] * workers
    per = len(mine) // workers
    return [tuple(mine[i * per : (i + 1) * per]) for i in range(workers)]


class GangFit:
    """Starts the gang, follows member 0's lines, and ends every member on a cancel, a failure or a return."""

    def __init__(self, job: GangJob) -> None:
        self.job = job
        self.procs: list[Any] = []
        self.progress = job.folder / "progress.jsonl"
        self.snapshots = job.folder / "snapshots"

    def spec(self, port: int) -> gangfit.GangSpec:
        job, files = self.job, {}
        named = {**job.arrays, **{f"val_{k}": a for k, a in (job.validation or {}).items()}}
        for name, array in named.items():
            path = job.folder / f"{name}.npy"
            if not path.exists():
                np.save(path, array, allow_pickle=False)
            files[name] = str(path)
        address = f"127.0.0.1:{port}"  # members of a local gang reach each other on this machine's loopback only
        return gangfit.GangSpec(
            coordinator=address,
            bind=address,
            num_processes=job.workers,
            process_id=0,
            model=str(job.model_path),
            x=files["x"],
            y=files.get("y"),
            sample_weight=files.get("sample_weight"),
            val_x=files.get("val_x"),
            val_y=files.get("val_y"),
            val_sample_weight=files.get("val_sample_weight"),
            validation_batch_size=job.validation_batch_size,
            callbacks=job.callbacks,
            batch_size=job.batch_size,
            epochs=job.epochs,
            initial_epoch=job.initial_epoch,
            shuffle=job.shuffle,
            seed=job.seed,
            out=str(job.folder / "trained.keras"),
            history=str(job.folder / "history.json"),
            progress=str(self.progress),
            snapshots=str(self.snapshots),
            objects=job.objects or None,
            paths=tuple(p for p in sys.path if p),
            safe_mode=job.safe_mode,
        )

    def start(self) -> None:
        self.job.folder.mkdir(parents=True, exist_ok=True)
        self.snapshots.mkdir(exist_ok=True)
        self.progress.unlink(missing_ok=True)
        spec = self.spec(gangfit.free_port())
        shares = cpu_shares(self.job.workers)
        self.procs = gangfit.start_local(spec, self.job.folder, cpus=shares)

    def run(
        self,
        on_epoch: Callable[[Epoch], None],
        on_batch: Callable[[dict[str, Any]], None],
        cancel: threading.Event,
        on_end: Callable[[Path], None] = lambda _: None,
        check: Callable[[], None] = lambda: None,
    ) -> bool:
        """Follow the gang to its end; False when `cancel` ended it. A member that fails raises with its log;
        `check` raises what ended the job's processes from outside (its memory limit) before a lost member is
        taken for a fault to recover from."""
        for _ in range(PORT_ATTEMPTS):
            self.start()
            try:
                outcome = self._follow(on_epoch, on_batch, cancel, on_end, check)
            finally:
                self.end()
            if outcome is not None:
                return outcome
        raise RuntimeError(f"no free port on 127.0.0.1 for the gang's coordinator in {PORT_ATTEMPTS} attempts")

    def _follow(
        self,
        on_epoch: Callable[[Epoch], None],
        on_batch: Callable[[dict[str, Any]], None],
        cancel: threading.Event,
        on_end: Callable[[Path], None],
        check: Callable[[], None],
    ) -> bool | None:
        """True when every member ended well, False on cancel, None when member 0 found its port taken."""
        pending = b""
        with contextlib.ExitStack() as stack:
            reader = None
            while True:
                check()
                if cancel.is_set():
                    return False
                codes = [p.poll() for p in self.procs]  # before reading: an exit seen here wrote all it will
                if reader is None and self.progress.exists():
                    reader = stack.enter_context(open(self.progress, "rb"))
                chunk = reader.read() if reader is not None else b""
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._line(json.loads(line), on_epoch, on_batch, on_end)
                if chunk:
                    continue
                if codes[0] == gangfit.PORT_TAKEN_EXIT:
                    return None
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    check()
                    lost = [i for i in failed if (codes[i] or 0) < 0]
                    first = lost[0] if lost else failed[0]
                    raise (GangLost if lost else RuntimeError)(self.failure(first, codes[first]))
                if all(c == 0 for c in codes):
                    return True
                time.sleep(FOLLOW_S)

    def _line(
        self,
        line: dict[str, Any],
        on_epoch: Callable[[Epoch], None],
        on_batch: Callable[[dict[str, Any]], None],
        on_end: Callable[[Path], None],
    ) -> None:
        kind = line.get("kind")
        if kind == "epoch":
            on_epoch(Epoch(int(line["epoch"]), line["logs"], float(line["seconds"]), Path(line["snapshot"])))
        elif kind == "batch":
            on_batch(line)
        elif kind == "end" and line.get("snapshot"):
            on_end(Path(line["snapshot"]))

    def failure(self, member: int, code: int) -> str:
        log = self.job.folder / f"member-{member}.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        how = f"was killed by signal {-code}" if code < 0 else f"ended with status {code}"
        return f"worker {member} of the job's {self.job.workers} {how}\nits last output:\n{tail}"

    def end(self) -> None:
        """No member outlives the gang's run (the others would wait for a lost one until their heartbeat bound)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def put_values(model: Any, snapshot: Path) -> None:
    """An epoch's weights and optimizer variables (member 0's .npz) into the agent's own model, checked one by one."""
    with np.load(snapshot, allow_pickle=False) as npz:
        values = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    variables = list(model.weights) + list(model.optimizer.variables)
    if len(values) != len(variables):
        raise RuntimeError(
            f"the gang's model has {len(values)} weights and optimizer variables where this one has {len(variables)}"
        )
    for var, val in zip(variables, values):
        if tuple(var.shape) != tuple(val.shape):
            raise RuntimeError(f"the gang's value for {var.path} has shape {val.shape}, this model's {var.shape}")
        var.assign(val)


def fit_in_gang(
    job: GangJob,
    model: Any,
    pipeline: EpochPipeline,
    cancel: threading.Event,
    samples: int,
    check: Callable[[], None] = lambda: None,
    at_epoch_end: Callable[[], None] = lambda: None,
) -> bool:
    """Run the gang and pass each of its epochs through `pipeline` as the agent's own fit would; False if canceled.
    A member lost (killed, or gone silent) ends the others; the gang then starts again from the last epoch this
    model holds (at most MAX_RESTARTS times), so every epoch is reported once."""
    gangfit.ShardPlan(len(job.arrays["x"]), job.batch_size, job.workers)  # refused here, before a member starts
    if job.validation:
        gangfit.ShardPlan(len(job.validation["x"]), job.validation_batch_size or job.batch_size, job.workers)
    opt = model.optimizer
    if not opt.built:
        opt.build(model.trainable_variables)  # the variables each epoch's snapshot fills, in Keras' order
    done = job.initial_epoch

    def on_epoch(e: Epoch) -> None:
        nonlocal done
        at_epoch_end()
        put_values(model, e.snapshot)
        e.snapshot.unlink(missing_ok=True)
        data = {
            "epoch": e.epoch,
            "epochs": job.epochs,
            "logs": clean_logs(e.logs),
            "seconds": round(e.seconds, 4),
            "samples_per_s": round(samples / e.seconds, 2) if e.seconds > 0 else None,
            "ended": time.time(),
            "workers": job.workers,
        }
        pipeline.epoch_end(e.epoch, data)
        done = e.epoch + 1

    def on_batch(line: dict[str, Any]) -> None:
        fields = {k: line.get(k) for k in ("epoch", "batch", "steps")}
        pipeline.event(v.EV_BATCH, {**fields, "logs": clean_logs(line["logs"])})

    current = job
    for restart in range(MAX_RESTARTS + 1):
        try:
            return GangFit(current).run(on_epoch, on_batch, cancel, lambda final: put_values(model, final), check)
        except GangLost as exc:
            if restart == MAX_RESTARTS:
                raise RuntimeError(f"{exc}\n(the gang was started again {MAX_RESTARTS} times)") from None
            start = current.folder / f"restart-{restart + 1}.keras"
            model.save(start)  # this model holds the last epoch reported, optimizer state included
            current = replace(current, model_path=start, initial_epoch=done)
            lost = str(exc).splitlines()[0]
            pipeline.event(
                v.EV_LOG,
                {"message": f"{lost}: the {job.workers} workers start again from epoch {done + 1} (its checkpoint)"},
            )
    raise AssertionError("unreachable")
