"""One data-parallel `fit` across N processes (a gang), with Keras on the JAX backend (issue 37).

Why JAX: Keras 3 `fit` under TensorFlow's `MultiWorkerMirroredStrategy` fails upstream (keras-team/keras#20585);
Keras' own distribution API on JAX works across processes (gloo collectives on CPU), and its `.keras` file loads back
in a TensorFlow-backend process with the optimizer state (../shared/notes/one-job-many-machines.md).

Each member of the gang is its own process, `python -m aibro_backend.worker.gangfit SPEC.json`, never the agent's
TensorFlow process: `KERAS_BACKEND=jax` must be set before Keras is first imported, so this module imports Keras only
inside `fit_in_gang`, after setting it (and refuses to run where Keras was already imported with another backend).

What the scheduler and the agent must hand every member (`GangSpec`, JSON; see `GangSpec.load`):

* `coordinator` "HOST:PORT": where member 0 serves JAX's coordination service. Every member connects to it, so it is
  an address all of them reach; member 0 binds `bind` (default: the coordinator address itself, never 0.0.0.0
  unless told; give the job network's address). The port must be free on member 0's host: the launcher picks it
  and starts again with another one when
  member 0 says it is taken (`PORT_TAKEN_EXIT`). Gloo then makes its own connections: each member listens on an
  ephemeral port (seen with `ss`: one per member, besides the coordinator's) at the address its host name resolves
  to, and publishes it through the coordinator. So (1) a sandbox must let the gang's members reach each other on any
  port, not only the coordinator's, and (2) each member's host name must resolve to an address the others reach
  (here it resolves to 127.0.0.1, fine for a local gang; Debian's /etc/hosts maps it to 127.0.1.1, which would break
  a gang across hosts). jax 0.10 has no public setting for gloo's address; its private
  `jaxlib._jax.make_gloo_tcp_collectives(client, hostname=, interface=)` takes one (would go in aibro_core/compat).
  Not yet tried across real hosts.
* `num_processes` N and `process_id` i (0 ≤ i < N; 0 is the coordinator and the only one that writes the model).
* The shard: every member gets the SAME arrays (`x`, `y`, optional `sample_weight`: .npy files, opened memory-mapped,
  so a member reads only its rows) and the same `batch_size` (the global batch, as the user wrote it), `epochs`,
  `initial_epoch`, `shuffle` and `seed`; `ShardPlan` derives the member's rows of every step from them, so nothing
  per member needs computing upstream and the steps per epoch are equal on all members by construction (unequal
  steps hang a collective).
* `model` (a `.keras` file, e.g. the kernel's bundle saved under TensorFlow) and `out` (where member 0 writes the
  trained `.keras`; the others write nothing), `history` (member 0's History as JSON), `progress` (optional: member 0
  writes a JSON line per epoch there, flushed, a FIFO works), `weights` (optional: every member's final weights as
  .npz, "{process_id}" in it replaced, for tests and checks).
* `heartbeat_timeout_s`, `init_timeout_s`, `shutdown_timeout_s`: how long a lost member may stall the others (below).

Not yet here (the next steps): x/y as trees of arrays or a tf.data dataset (only one .npy each now), validation
data (it too needs equal steps on every member), the user's callbacks (member 0's, as the agent's callbacks.py runs
them; `progress` is the hook for the agent's epoch events), resuming from an epoch checkpoint (`initial_epoch` and a
model file are enough on this side).

The global batch of B rows at step k is rows [kB, (k+1)B) of the epoch's order (the identity, or one permutation per
epoch drawn from `seed`, the same on every member); member i takes its i-th B/N of them, so the gang computes the
gradient of exactly the batch a one-process `fit(batch_size=B, shuffle=False)` computes (float order aside). B must
be a multiple of N. The remainder r = rows mod B: a one-process fit runs a short last batch of r rows; here the last
step takes the largest multiple of N in r (r - r mod N rows, split evenly) and drops the other r mod N < N rows of
that epoch: every step identical to the one-process fit when N divides r, at most N-1 rows per epoch unseen otherwise
(with `shuffle` they are different rows each epoch). A step must have the same shape on every member (a JAX global
array), so an uneven split cannot run, and padding with zero-weight rows would change the loss' mean.

Faults, measured with 2 members on 127.0.0.1 (tests/test_gangfit.py): a member killed mid-fit (either one, the
coordinator too) resets its gloo connections, the other's collective raises at once and `main` exits 1 within
~0.2 s (without `os._exit` it would then wait in JAX's shutdown barrier for the lost member until the heartbeat
bound). A member that stops answering without a reset (SIGSTOP here; a host frozen or cut off) is found by the
coordination service when its heartbeats have been missing for `heartbeat_timeout_s`, and JAX aborts every other
member (SIGABRT, status -6; 5.7 to 9.9 s with 10, in four runs). Default 60 s, not JAX's 100: the heartbeats come
from a C++ thread, not Python, so a long step or a loaded host does not delay them, and a minute bounds what a job
pays for a lost machine (a spot notice gives two). A member that never arrives ends the others after
`init_timeout_s` (300: N machines of a gang may boot minutes apart); member 1 waits in the shutdown barrier while
member 0 saves, up to `shutdown_timeout_s`. A member ending so exits non-zero, which is what the agent watches for.

Saving: process 0 alone calling `model.save()` under the distribution deadlocks (saving makes a throwaway optimizer
whose variables are a cross-process step). Every member holds every weight under `DataParallel`, so member 0 drops
the distribution first, then saves; the others only wait in JAX's shutdown barrier.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

PORT_TAKEN_EXIT = 75
"""Member 0's exit status when the coordinator's port is taken: the launcher starts the gang again on another."""

_ARRAYS = ("x", "y", "sample_weight")
_VALIDATION = {"val_x": "x", "val_y": "y", "val_sample_weight": "sample_weight"}
# How jax 0.10's coordination service says its port is taken (gRPC logs "No address added", then this).
_BIND_FAILED = ("failed to start rpc server", "address already in use", "failed to bind")


@dataclass(frozen=True)
class ShardPlan:
    """Which rows each member trains on at each step: equal step counts and equal step shapes on every member."""

    rows: int
    global_batch: int
    num_processes: int

    def __post_init__(self) -> None:
        if self.num_processes < 1 or self.global_batch < 1 or self.rows < 1:
            raise ValueError(f"rows, batch size and processes must be positive: {self}")
        if self.global_batch % self.num_processes:
            raise ValueError(
                f"batch_size {self.global_batch} is not a multiple of the {self.num_processes} workers: each worker "
                "takes an equal part of every batch"
            )
        if self.rows < self.num_processes:
            raise ValueError(f"{self.rows} rows cannot feed {self.num_processes} workers")

    @property
    def last_batch(self) -> int:
        """Rows in the last global batch: the remainder rounded down to a multiple of N (B if no remainder)."""
        rest = self.rows % self.global_batch
        if rest == 0:
            return self.global_batch
        return rest - rest % self.num_processes or self.global_batch

    @property
    def steps(self) -> int:
        full, rest = divmod(self.rows, self.global_batch)
        return full + (1 if rest >= self.num_processes else 0)

    @property
    def dropped(self) -> int:
        """Rows of each epoch that no step sees (at most N - 1)."""
        return self.rows - (self.steps - 1) * self.global_batch - self.last_batch

    def rows_of(self, step: int, process_id: int, order: np.ndarray | None = None) -> np.ndarray:
        """Member `process_id`'s rows at `step`: its part of global batch `step` of the epoch's `order`."""
        size = self.global_batch if step < self.steps - 1 else self.last_batch
        share = size // self.num_processes
        start = step * self.global_batch + process_id * share
        idx = np.arange(start, start + share)
        return idx if order is None else order[idx]

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's permutation of all rows, the same on every member (drawn from the job's seed and the epoch)."""
        return np.random.default_rng([seed, epoch]).permutation(self.rows)


@dataclass(frozen=True)
class GangSpec:
    """Everything one member needs; the same for all but `process_id` (see the module docstring)."""

    coordinator: str
    num_processes: int
    process_id: int
    model: str
    x: str
    y: str | None
    batch_size: int
    epochs: int
    out: str
    history: str
    sample_weight: str | None = None
    initial_epoch: int = 0
    shuffle: bool = False
    seed: int = 0
    bind: str | None = None
    weights: str | None = None
    progress: str | None = None
    snapshots: str | None = None
    val_x: str | None = None
    val_y: str | None = None
    val_sample_weight: str | None = None
    validation_batch_size: int | None = None
    callbacks: tuple[dict[str, Any], ...] = ()
    objects: dict[str, Any] | None = None
    paths: tuple[str, ...] = ()
    safe_mode: bool = True
    cpus: tuple[int, ...] | None = None
    heartbeat_timeout_s: int = 60
    init_timeout_s: int = 300
    shutdown_timeout_s: int = 300

    def __post_init__(self) -> None:
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id {self.process_id} is not in [0, {self.num_processes})")

    @classmethod
    def load(cls, path: str | Path) -> GangSpec:
        fields = json.loads(Path(path).read_text())
        for name in ("paths", "cpus", "callbacks"):  # JSON has lists; the spec is frozen, its sequences tuples
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        return cls(**fields)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    def member(self, process_id: int, **changes: Any) -> GangSpec:
        return GangSpec(**{**asdict(self), "process_id": process_id, **changes})


def _jax_keras() -> Any:
    """Keras on JAX in this process, or a clear refusal: the backend is fixed at Keras' first import."""
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "jax":
        raise RuntimeError("gangfit runs in a process of its own: Keras was already imported here with another backend")
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    return keras


def _join(spec: GangSpec) -> None:
    """Join the gang through JAX's coordination service, with the spec's bounds (Keras' `initialize` passes none)."""
    import jax

    bind = spec.bind or spec.coordinator  # never every interface unless told: the coordinator's own address
    if spec.process_id == 0 and not _can_bind(bind):
        # Checked here because jax 0.10 does not fail cleanly on a taken port (gRPC logs "No address added", then
        # the process raises or, as often, dies of SIGSEGV). A plain bind also fails against a port another gang's
        # gRPC server holds with SO_REUSEPORT (gRPC sets it on Linux, so gRPC itself would share the port).
        print(f"gangfit: the coordinator's address {bind} is taken", file=sys.stderr)
        raise SystemExit(PORT_TAKEN_EXIT)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # jax 0.10's default; CPU collectives need one
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            coordinator_bind_address=bind,
            initialization_timeout=spec.init_timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
            shutdown_timeout_seconds=spec.shutdown_timeout_s,
        )
    except Exception as exc:  # taken in the moment between the check and gRPC's bind
        if spec.process_id == 0 and any(m in str(exc).lower() for m in _BIND_FAILED):
            print(f"gangfit: the coordinator's address {bind} is taken: {exc}", file=sys.stderr)
            raise SystemExit(PORT_TAKEN_EXIT) from exc
        raise


def _can_bind(address: str) -> bool:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT leftovers are no owner
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


def _load_arrays(paths: dict[str, str | None], what: str) -> dict[str, np.ndarray]:
    arrays = {name: np.load(p, mmap_mode="r") for name, p in paths.items() if p is not None}
    rows = {name: len(a) for name, a in arrays.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"the {what} arrays differ in rows: {rows}")
    return arrays


def fit_in_gang(spec: GangSpec) -> dict[str, list[float]]:
    """Join the gang, fit this member's shard, and (member 0) save the trained model. Returns the History."""
    arrays = _load_arrays({name: getattr(spec, name) for name in _ARRAYS}, "training")
    plan = ShardPlan(len(arrays["x"]), spec.batch_size, spec.num_processes)  # refused before the gang forms
    held_out = _load_arrays({short: getattr(spec, name) for name, short in _VALIDATION.items()}, "validation")
    val_plan = None
    if held_out:
        # Validation too must take equal steps on every member: its batches split as the training's do.
        val_plan = ShardPlan(len(held_out["x"]), spec.validation_batch_size or spec.batch_size, spec.num_processes)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # before JAX sizes its thread pools from what this process may use
    sys.path[:0] = [p for p in spec.paths if p not in sys.path]  # the job's own code, as the agent's gear-up put it
    keras = _jax_keras()
    _join(spec)
    # The same seed on every member before anything random runs: Keras' own initialize would agree on one by a
    # collective; the job's seed makes that unnecessary and repeatable.
    keras.utils.set_random_seed(spec.seed)
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))

    objects = _objects(spec)
    with keras.saving.custom_object_scope(objects):
        model = keras.saving.load_model(spec.model, custom_objects=objects, safe_mode=spec.safe_mode)
    data, epoch_order = _shard_dataset(keras, plan, arrays, spec, spec.shuffle)
    validation = _shard_dataset(keras, val_plan, held_out, spec, False)[0] if val_plan is not None else None
    # The user's callbacks that only read the epoch's logs and set the model's state run on every member: the logs
    # are the gang's (global), so each member decides as the others do (EarlyStopping stops all of them together).
    callbacks = [*_user_callbacks(spec), epoch_order]
    if spec.progress and spec.process_id == 0:
        callbacks.append(_Progress(keras, spec.progress, plan.steps, spec.snapshots))
    history = model.fit(
        data,
        callbacks=callbacks,
        validation_data=validation,
        epochs=spec.epochs,
        initial_epoch=spec.initial_epoch,
        verbose=0,
        shuffle=False,  # the order is the dataset's: one permutation per epoch shared by all members
    )
    if spec.weights:
        np.savez(spec.weights.format(process_id=spec.process_id), *model.get_weights())
    if spec.process_id == 0:
        keras.distribution.set_distribution(None)
        model.save(spec.out)
        Path(spec.history).write_text(json.dumps(history.history))
    return history.history


def _user_callbacks(spec: GangSpec) -> list[Any]:
    if not spec.callbacks:
        return []
    from pydantic import TypeAdapter

    from aibro_core.models import Callback

    from .usercallbacks import build_callbacks

    return build_callbacks(TypeAdapter(list[Callback]).validate_python(list(spec.callbacks)), None)


def _objects(spec: GangSpec) -> dict[str, Any]:
    """The classes and functions the model names, found as the agent finds them (aibro_core.objectrefs)."""
    if not spec.objects:
        return {}
    from aibro_core.objectrefs import resolve

    return resolve(spec.objects)


BATCH_LINE_INTERVAL_S = 0.5


def _Progress(keras: Any, path: str, steps: int, snapshots: str | None) -> Any:
    """Member 0 writes one JSON line per epoch ({"kind": "epoch", "epoch": E, "logs": {...}, "seconds": S,
    "snapshot": NPZ}), a few times a second one per batch ({"kind": "batch", ...}) and one when training ends
    ({"kind": "end", "snapshot": NPZ}: the weights as the user's callbacks left them) to `path`, flushed at once:
    the agent (or a test) follows the fit from outside; a FIFO works. With `snapshots`, each epoch's weights and
    optimizer variables are written there first (an .npz, complete before its line): the agent's checkpoint of
    that epoch. Every member holds every weight under DataParallel, so member 0 reads its own copies alone (no
    collective), after Keras has synced them back into the variables for the epoch's callbacks."""

    class Progress(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.out = open(path, "w", buffering=1)  # noqa: SIM115 (open for the whole fit)
            self.started = self.last_batch = 0.0
            self.epoch = 0

        def line(self, kind: str, **fields: Any) -> None:
            self.out.write(json.dumps({"kind": kind, **fields}) + "\n")

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self.started, self.epoch = time.monotonic(), epoch

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            now = time.monotonic()
            if now - self.last_batch >= BATCH_LINE_INTERVAL_S:
                self.last_batch = now
                self.line("batch", epoch=self.epoch, batch=batch, steps=steps, logs=_floats(logs))

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            seconds = time.monotonic() - self.started
            snapshot = self.snapshot(f"epoch-{epoch + 1}.npz")
            self.line("epoch", epoch=epoch, logs=_floats(logs), seconds=round(seconds, 4), snapshot=snapshot)

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            # After the user's callbacks' own train end (EarlyStopping may have put its best weights back).
            self.line("end", snapshot=self.snapshot("final.npz"))
            self.out.close()

        def snapshot(self, name: str) -> str | None:
            if not snapshots:
                return None
            path = os.path.join(snapshots, name)
            values = [keras.ops.convert_to_numpy(v.value) for v in self.model.weights]
            values += [keras.ops.convert_to_numpy(v.value) for v in self.model.optimizer.variables]
            with open(path + ".part", "wb") as f:
                np.savez(f, *values)
            os.replace(path + ".part", path)
            return path

    return Progress()


def _floats(logs: dict[str, Any] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (logs or {}).items()}


def _shard_dataset(
    keras: Any, plan: ShardPlan, arrays: dict[str, np.ndarray], spec: GangSpec, shuffle: bool
) -> tuple[Any, Any]:
    """A PyDataset over this member's rows (Keras' own shuffling would differ between members) and the callback that
    tells it the epoch: Keras calls a PyDataset's `on_epoch_end` also when it resets its iterator, so counting those
    calls drifts from the fit's epoch; `Callback.on_epoch_begin` gets the epoch itself, before the epoch's first
    batch is read (one worker thread: no batch is read ahead)."""

    class Shard(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = spec.initial_epoch

        def __len__(self) -> int:
            return plan.steps

        def __getitem__(self, step: int) -> tuple[np.ndarray, ...]:
            order = plan.order(spec.seed, self.epoch) if shuffle else None
            idx = plan.rows_of(step, spec.process_id, order)
            if order is not None:
                idx = np.sort(idx)  # memory-mapped reads in file order; the rows of a step are a set
            return tuple(np.asarray(arrays[name][idx]) for name in _ARRAYS if name in arrays)

    class EpochOrder(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            shard.epoch = epoch

    shard = Shard()
    return shard, EpochOrder()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free at this moment; another process may take it before member 0 binds it (then `PORT_TAKEN_EXIT`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_local(
    spec: GangSpec,
    folder: Path,
    env: dict[str, str] | None = None,
    cpus: Sequence[tuple[int, ...] | None] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start every member of `spec`'s gang on this host, one process each (spec.process_id is ignored), member I on
    the cores `cpus[I]` (all of them where None); their specs and logs in `folder` (member-I.json, member-I.log)."""
    procs = []
    for i in range(spec.num_processes):
        path = folder / f"member-{i}.json"
        spec.member(i, cpus=cpus[i] if cpus else None).dump(path)
        with open(folder / f"member-{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "aibro_backend.worker.gangfit", str(path)],
                    env={**(os.environ if env is None else env), "KERAS_BACKEND": "jax"},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    return procs


def run_local(
    spec: GangSpec, folder: Path, *, timeout_s: float, host: str = "127.0.0.1", attempts: int = 5
) -> list[int]:
    """Run a whole gang on this host to its end and return the members' exit statuses; a coordinator port taken
    between `free_port` and member 0's bind starts the gang again on another (at most `attempts` times). Members
    still running after `timeout_s` are killed (their status then is -9)."""
    for _ in range(attempts):
        port = free_port(host)
        procs = start_local(replace(spec, coordinator=f"{host}:{port}", bind=f"{host}:{port}"), folder)
        codes = wait_all(procs, timeout_s)
        if codes[0] != PORT_TAKEN_EXIT:
            return codes
    raise RuntimeError(f"no free coordinator port on {host} in {attempts} attempts")


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Every member's exit status; a member that ends in failure ends the rest at once (the gang cannot go on
    without it; the survivors would only wait for their heartbeat bound), and past `timeout_s` all are killed."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        proc = pending[0]
        try:
            proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                break
            pending.append(pending.pop(0))
            continue
        pending.pop(0)
        if proc.returncode != 0:
            break
    for proc in pending:
        proc.kill()
        proc.wait()
    return [int(p.returncode) for p in procs]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m aibro_backend.worker.gangfit SPEC.json", file=sys.stderr)
        return 2
    try:
        fit_in_gang(GangSpec.load(args[0]))
    except SystemExit:
        raise
    except BaseException:
        # A failed collective (a member gone: gloo's connection reset) raises here at once; a normal exit would then
        # wait in JAX's shutdown barrier for the lost member until the heartbeat bound. The error is what counts.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
