"""Epoch-end work off the training thread: checkpoint save + upload, then the epoch event, in order.

The training thread only copies the weights (milliseconds) and goes on with the next epoch. A background
thread turns them into a `.keras` checkpoint, uploads it, and only then queues the epoch event, so an epoch in
the event log always has its checkpoint to resume from. Every event from the training callback passes through
the same queue, so the log keeps training order.

The first checkpoint is Keras' own save of a second copy of the model holding the snapshot; later ones are
written straight from the snapshot's bytes (checkpointfile.CheckpointFile) once that writer has reproduced the
first, because a Keras save on this thread holds the GIL for tens of milliseconds against the training loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aibro_core.kerasfile import keras_notes_quiet, note_optimizers

from .checkpointfile import CheckpointFile, cache_keras_save_walk
from .outbox import Outbox

log = logging.getLogger("aibro.worker")
MAX_PENDING_CHECKPOINTS = 2


class EpochPipeline:
    def __init__(
        self,
        outbox: Outbox,
        model: Any,
        load_shadow: Callable[[], Any] | None,
        upload_checkpoint: Callable[[Path, int], None],
        scratch: Path,
        direct: bool = True,
    ) -> None:
        """`load_shadow` builds a second copy of the model (None: save the live model on the training thread);
        `upload_checkpoint(path, epoch)` uploads one saved checkpoint; `scratch` is a private directory for the
        files while they are written and uploaded; `direct=False` keeps Keras' save for every checkpoint (for
        benchmarks that compare the two)."""
        self.outbox = outbox
        self.model = model
        self.upload_checkpoint = upload_checkpoint
        self.scratch = scratch
        self._file: CheckpointFile | None = None
        self._file_checked = False
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._slots = threading.Semaphore(MAX_PENDING_CHECKPOINTS)
        self._error: BaseException | None = None
        self._shadow: Any = None
        self._shadow_ready = threading.Event()
        self._checked: bool | None = None
        self._load_shadow = load_shadow
        self._direct = direct
        self._thread = threading.Thread(target=self._run, name="aibro-epoch-pipeline", daemon=True)
        self._thread.start()

    # -- called from the training thread -----------------------------------------------------------
    def event(self, type_: str, data: dict[str, Any]) -> None:
        """Queue an event stamped now: it may wait behind a checkpoint upload, and its time is when it happened."""
        self._raise_if_failed()
        self._queue.put(("event", (type_, data, time.time())))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the pipeline thread, in order with the events and checkpoints (a file to upload)."""
        self._raise_if_failed()
        self._queue.put(("call", fn))

    def epoch_end(self, epoch: int, data: dict[str, Any]) -> None:
        """Checkpoint `epoch`, then emit its event; blocks only when checkpoints pile up faster than they upload."""
        self._raise_if_failed()
        if self._load_shadow is not None and self._checked is None:
            self._shadow_ready.wait(timeout=600)
            self._checked = self._shadow is not None and self._compatible(self._shadow)
        if not self._checked:
            path = self.scratch / "live.keras"
            try:
                with keras_notes_quiet():
                    self.model.save(path)
                note_optimizers(self.model, path)  # a GAN's own optimizers resume with their state
                self.upload_checkpoint(path, epoch)
            finally:
                path.unlink(missing_ok=True)
            self._queue.put(("event", ("epoch", data, None)))
            return
        self._slots.acquire()
        snapshot = (
            [w.numpy() for w in self.model.weights],
            [w.numpy() for w in self.model.optimizer.variables],
        )
        self._queue.put(("checkpoint", (epoch, snapshot, data)))

    def drain(self) -> None:
        """Wait until every checkpoint is uploaded and every event is in the outbox."""
        done = threading.Event()
        self._queue.put(("mark", done))
        while not done.wait(0.5):
            if not self._thread.is_alive():
                break
        self._raise_if_failed()

    @property
    def writes_directly(self) -> bool:
        """Whether checkpoints are now written straight from the snapshot (not by a Keras save)."""
        return self._file is not None and self._file_checked

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join(timeout=60)

    # -- the background thread -------------------------------------------------------------------------
    def _run(self) -> None:
        cache_keras_save_walk()  # here, not on the training thread: it builds a few throwaway Keras objects
        if self._load_shadow is not None:
            try:
                self._shadow = self._load_shadow()
            except Exception:  # noqa: BLE001 - fall back to saving the live model
                log.exception("could not build the checkpoint copy; checkpoints are saved on the training thread")
            if self._shadow is not None:
                self._build_optimizer(self._shadow)
            self._shadow_ready.set()  # the training thread only reads the copy's shapes from here on
            if self._shadow is not None and self._direct:
                self._learn_layout()
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "mark":
                item.set()
                continue
            if self._error is not None:
                if kind == "checkpoint":
                    self._slots.release()
                continue
            try:
                if kind == "event":
                    self.outbox.put(*item)
                elif kind == "call":
                    item()
                else:
                    epoch, (weights, opt_vars), data = item
                    try:
                        self._checkpoint(epoch, weights, opt_vars)
                    finally:
                        self._slots.release()
                    self.outbox.put("epoch", data)
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread
                self._error = exc

    @staticmethod
    def _build_optimizer(shadow: Any) -> None:
        """The copy's optimizer variables, which a model saved before its first step does not have yet."""
        try:
            opt = getattr(shadow, "optimizer", None)
            if opt is not None and not opt.built:
                opt.build(shadow.trainable_variables)
        except Exception:  # noqa: BLE001 - `_compatible` then finds the copy unusable
            log.exception("could not build the checkpoint copy's optimizer")

    def _learn_layout(self) -> None:
        """Learn where each variable lives in the checkpoint file (while the first epoch trains; the first
        checkpoint waits for it on this thread); any failure leaves Keras' save in charge."""
        try:
            opt = getattr(self._shadow, "optimizer", None)
            if opt is not None and opt.built:
                self._file = CheckpointFile.learn(self._shadow, self.scratch)
        except Exception:  # noqa: BLE001 - only speed depends on it
            log.exception("could not learn the checkpoint layout; every checkpoint is saved by Keras")
            self._file = None

    def _checkpoint(self, epoch: int, weights: list[Any], opt_vars: list[Any]) -> None:
        """Save and upload one checkpoint: written straight from the snapshot once the writer has reproduced
        Keras' own save of the first checkpoint, by Keras until then (for good where it did not, and again for
        an epoch whose config changed, e.g. a new learning rate: the writer adopts that save's config)."""
        path = self.scratch / f"epoch-{epoch + 1}.keras"
        values = weights + opt_vars
        try:
            direct = self.writes_directly and self._file.write(values, path)
            if not direct:
                self._write(weights, opt_vars)
                self._shadow.save(path)
            self.upload_checkpoint(path, epoch)
            if self._file is not None and not direct:
                try:
                    adopted = self._file.adopt(path, values, self.scratch, check=not self._file_checked)
                except Exception:  # noqa: BLE001 - only speed depends on it
                    log.exception("checking the checkpoint writer failed")
                    adopted = False
                if adopted and not self._file_checked:
                    log.info("checkpoints after this one are written straight from the weights snapshot")
                self._file_checked = True
                if not adopted:
                    log.info("the checkpoint writer did not reproduce Keras' save; every checkpoint is saved by Keras")
                    self._file = None
        finally:
            path.unlink(missing_ok=True)

    def _compatible(self, shadow: Any) -> bool:
        """The copy must hold exactly the live model's variables, optimizer state included; a model with optimizers
        of its own besides `optimizer` (a GAN's) is saved whole each epoch instead."""
        from aibro_core.kerasfile import optimizers_of

        opt = getattr(shadow, "optimizer", None)  # a model no compile() was given has no attribute at all
        if (
            opt is None
            or getattr(self.model, "optimizer", None) is None
            or set(optimizers_of(self.model)) != {"optimizer"}
        ):
            return False
        if not opt.built:
            opt.build(shadow.trainable_variables)
        mine = shadow.weights + opt.variables
        live = self.model.weights + self.model.optimizer.variables
        return len(mine) == len(live) and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(mine, live))

    def _write(self, weights: list[Any], opt_vars: list[Any]) -> None:
        for var, val in zip(self._shadow.weights, weights):
            var.assign(val)
        for var, val in zip(self._shadow.optimizer.variables, opt_vars):
            var.assign(val)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"saving a checkpoint or sending a file back failed: {self._error}") from self._error


def shadow_loader(
    keras: Any,
    path: Path,
    safe_mode: bool,
    compile_args: dict[str, Any] | None = None,
    objects: dict[str, Any] | None = None,
) -> Callable[[], Any]:
    """A loader for the checkpoint copy: the same file the live model came from, compiled as the live one was."""

    def load() -> Any:
        return load_job_model(keras, path, safe_mode, compile_args, objects or {})

    return load


def load_job_model(
    keras: Any, path: Path, safe_mode: bool, compile_args: dict[str, Any] | None, objects: dict[str, Any]
) -> Any:
    """A job's model from its file: loaded with the objects it names, compiled again with its own compile()'s
    arguments when its class overrides compile(), and every optimizer's state restored (kerasfile)."""
    from aibro_core.kerasfile import restore_optimizers

    from .usercallbacks import compile_again

    with keras_notes_quiet():
        model = keras.saving.load_model(path, custom_objects=objects, safe_mode=safe_mode)
    if compile_args is not None:
        with keras.saving.custom_object_scope(objects):
            compile_again(model, compile_args)
    for problem in restore_optimizers(model, path):
        log.warning("optimizer state not restored from %s: %s", path.name, problem)
    return model
