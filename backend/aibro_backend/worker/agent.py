"""The worker's main loop: assignment → gear up → fetch model & data → fit → return → cool."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from aibro_core import backoff
from aibro_core import vocabulary as v
from aibro_core.errors import ApiError, AuthError, BackendUnreachable
from aibro_core.files import private_dir, write_private
from aibro_core.kerasfile import KERAS_NOTES
from aibro_core.models import JobSpec, ObjectRef
from aibro_core.presigned import S3_RETRY_S, broke_off, upload_file_via_s3
from aibro_core.transport import Transport, UntrustedCertificate

from . import heap, netbridge, version
from .joblimits import JobLimits, MemoryWatch
from .jobprocs import become_subreaper, end_job_processes
from .outbox import Outbox
from .settings import WorkerSettings
from .spot import SpotWatch, spot_watch_from_env

log = logging.getLogger("aibro.worker")
POLL_S = 0.2
POLL_AFTER_JOB_S = 0.05  # for the first seconds after a job: a study's next trial (or the user's next fit) comes then
# How long the backend may be unreachable before the agent gives up (AIBRO_BACKEND_GONE_S); on a cloud machine
# (AIBRO_SHUTDOWN_ON_LOSS=1, set by its user data) it then shuts the machine down, so nothing runs up a bill.
BACKEND_GONE_S = WorkerSettings.from_env().backend_gone_s
UPLOAD_CHUNK = 8 * 1024 * 1024  # one PUT of an artifact upload (the backend takes up to 64 MiB per request)
UPLOAD_TRIES = 10  # chunks in a row that fail before an upload gives up
MAX_LINE = 4000  # a line the job's code printed, as one log event
GLOBALS_MODULE = "__aibro_globals__"  # the notebook's arrays its travelling definitions import (aibro_jupyter/cellcode)


def retrying(fn: Callable[[], Any], what: str) -> Any:
    """Call `fn` until the backend answers; the backend may be restarting."""
    said = False

    def say_why_once(exc: Exception, attempt: int) -> None:
        nonlocal said
        if isinstance(exc, UntrustedCertificate) and not said:  # no fault of the network: say why, once
            log.error("%s: %s", what, exc)
            said = True

    return backoff.retry(fn, retry_on=BackendUnreachable, within_s=BACKEND_GONE_S, on_retry=say_why_once)


class Worker:
    _s3_uploads: bool | None = None  # whether artifacts go to S3 on presigned URLs (the backend's HEAD says)

    def __init__(self, url: str, token: str, instance_id: str, workdir: Path, limits: JobLimits | None = None) -> None:
        self.t = Transport(url, token, timeout=60)
        self.t.session.headers[version.HEADER] = version.agent_version()  # a job runs only on the backend's own code
        self.limits = limits or JobLimits()
        self.instance_id = instance_id
        self.workdir = workdir
        self.cache = private_dir(workdir / "cache")  # 0700 from the start, whatever umask the agent runs under
        self.code_root = private_dir(workdir / "code")
        self.env_cache = WorkerSettings.from_env().env_cache or workdir.parent / "envs"
        self.keras: Any = None
        self._code: Any = None
        self._active_env = False
        self.backend_lost = False
        self._outbox: Outbox | None = None
        self._releasing: threading.Thread | None = None  # the last fit's locals being freed (fitframe.py)
        self.spot: SpotWatch | None = spot_watch_from_env(os.environ, self._rebalance_recommended)

    def _rebalance_recommended(self, detail: dict[str, Any]) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.put(
                v.EV_LOG,
                {
                    "message": "AWS recommends a rebalance: this spot machine is at elevated risk of interruption; "
                    "training goes on until an interruption is announced",
                    "warning": "this spot machine may be reclaimed soon; the job would resume from its last epoch",
                },
            )

    def interrupted(self) -> bool:
        """Whether AWS announced that this spot machine is about to be reclaimed."""
        return self.spot is not None and self.spot.notice.is_set()

    def run(self) -> None:
        ended: float | None = None  # when the last job ended (monotonic)
        unsettled = 0  # jobs ended since the last full settle of the heap
        while True:
            if self.interrupted():
                log.info("leaving: this spot machine is being reclaimed")
                return
            try:
                a = retrying(lambda: self.t.json("GET", "/worker/assignment"), "assignment")
            except (AuthError, BackendUnreachable) as exc:
                self.backend_lost = isinstance(exc, BackendUnreachable)
                log.info("leaving: %s", exc)
                return
            if a["action"] == "exit":
                log.info("instance closing; exiting")
                return
            if a["action"] == "train":
                self.run_job(a)
                if self._releasing is not None:
                    self._releasing.join(timeout=60)
                    self._releasing = None
                # the job's garbage goes now, not inside the next job's fit; the full walk over everything TensorFlow
                # made (half a second) waits until the worker idles, so a study's next trial starts at once
                unsettled += 1
                heap.settle(full=unsettled >= heap.FULL_EVERY_JOBS)
                unsettled %= heap.FULL_EVERY_JOBS
                ended = time.monotonic()
                if self.interrupted():
                    log.info("leaving: this spot machine is being reclaimed")
                    return
            else:
                idle = None if ended is None else time.monotonic() - ended
                if unsettled and idle is not None and idle >= heap.IDLE_S:
                    heap.settle(full=True)
                    unsettled = 0
                time.sleep(POLL_AFTER_JOB_S if idle is not None and idle < heap.IDLE_S else POLL_S)

    # -- one job ----------------------------------------------------------------------------------
    def run_job(self, a: dict[str, Any]) -> None:
        job_id, attempt = a["job_id"], a["attempt"]
        outbox = Outbox(self.t, job_id, attempt)
        self._outbox = outbox
        try:
            spec = JobSpec.model_validate(a["spec"])  # as the backend stored it (records.SPEC_DUMP)
            outcome, error = self._train(outbox, job_id, attempt, spec, a.get("resume"), a.get("cancel"))
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the user, the worker lives on
            log.exception("job %s failed", job_id)
            error = self.limits.explain(exc) or f"{type(exc).__name__}: {exc}{netbridge.explain(exc)}"
            outcome = v.OUTCOME_FAILED
            outbox.put(v.EV_LOG, {"message": traceback.format_exc()[-4000:]})
        finally:
            self._outbox = None
            self._gear_down()
            end_job_processes()  # nothing the job started outlives it, detached or not
        if outbox.stale.is_set():
            outbox.close()
            return
        outbox.flush()
        outbox.close()
        body = {"attempt": attempt, "outcome": outcome, "error": error}
        try:
            retrying(lambda: self.t.json("POST", f"/worker/jobs/{job_id}/finish", json=body), "finish")
        except ApiError as exc:
            log.info("finish of %s refused: %s", job_id, exc)

    def _status(self, outbox: Outbox, substatus: str) -> None:
        outbox.put(v.EV_STATUS, {"status": v.TRAINING, "substatus": substatus})

    def _train(
        self, outbox: Outbox, job_id: str, attempt: int, spec: JobSpec, resume: dict | None, cancel: bool
    ) -> tuple[str, str | None]:
        if cancel:
            return v.OUTCOME_CANCELED, None
        if self.interrupted():
            return self._interrupted(outbox, resume["epoch"] if resume else 0)
        with MemoryWatch(self.limits.max_memory_bytes) as memory:
            try:
                return self._fit(outbox, job_id, attempt, spec, resume, memory)
            finally:
                if memory.peak:
                    log.info("job %s held at most %.0f MiB", job_id, memory.peak / (1 << 20))

    def _fit(
        self, outbox: Outbox, job_id: str, attempt: int, spec: JobSpec, resume: dict | None, memory: MemoryWatch
    ) -> tuple[str, str | None]:
        self._status(outbox, v.GEARING_UP_ENV)
        if spec.workers > 1:
            from .gangrun import require_jax

            require_jax(spec.workers)
        keras = self._gear_up(outbox, job_id, attempt, spec)
        self._status(outbox, v.SENDING_MODEL_DATA)
        from aibro_core.objectrefs import resolve

        objects = resolve(spec.objects)
        with keras.saving.custom_object_scope(objects):
            return self._fit_with(outbox, job_id, attempt, spec, resume, memory, keras, objects)

    def _fit_with(
        self,
        outbox: Outbox,
        job_id: str,
        attempt: int,
        spec: JobSpec,
        resume: dict | None,
        memory: MemoryWatch,
        keras: Any,
        objects: dict[str, Any],
    ) -> tuple[str, str | None]:
        """The fit itself, where every Keras load and every rebuilt argument finds the objects the model names."""
        from .datatree import fit_data

        clock = time.perf_counter()
        x, y, sw, validation_data = fit_data(spec.data, self.fetch_blob)
        ready = {"data": time.perf_counter() - clock}  # what the job's start spent where (ready_note)
        fit = spec.fit.model_dump(exclude_unset=True)  # the arguments the user gave; Keras' defaults for the rest
        if isinstance(fit.get("class_weight"), dict):  # JSON keys are text; Keras looks classes up by integer
            fit["class_weight"] = {int(k): float(w) for k, w in fit["class_weight"].items()}
        trial = None  # a study trial's build, kept for its fit (worker/trialbuild.py)
        if resume:
            model_path = self.fetch_artifact(job_id, resume["checkpoint"])
            fit["initial_epoch"] = resume["epoch"]
            outbox.put(v.EV_LOG, {"message": f"resuming from {resume['checkpoint']} at epoch {resume['epoch']}"})
            if spec.trial is not None:  # a study trial fits on as its first attempt did
                from .trialbuild import trial_run

                trial = trial_run(spec.trial)
        elif spec.trial is not None:
            from .trialbuild import build_trial_model

            model_path = self.workdir / "model.keras"
            model_path.unlink(missing_ok=True)
            clock = time.perf_counter()
            trial = build_trial_model(spec.trial, model_path, self.fetch_earlier_model, objects)
            ready["build"] = time.perf_counter() - clock
            if spec.trial.resume_job:
                earlier = f"trial {spec.trial.values.get('tuner/trial_id')} ({spec.trial.resume_job})"
                outbox.put(v.EV_LOG, {"message": f"starting from the trained weights of {earlier}"})
        else:
            model_path = self.workdir / "model.keras"
            model_path.unlink(missing_ok=True)
            model_path.symlink_to(self.fetch_blob(str(spec.model)))
        if spec.seed is not None:
            # As the kernel did before it built the model: the layers drawing default seeds as they are rebuilt
            # (Dropout's) and fit's shuffling then draw what they drew there.
            keras.utils.set_random_seed(spec.seed)
        clock = time.perf_counter()
        model = self._load_model(keras, model_path, spec.safe_mode, spec.compile, objects)
        ready["load"] = time.perf_counter() - clock
        outbox.put(v.EV_LOG, ready_note(ready))
        memory.check()
        self._status(outbox, v.SUB_TRAINING)
        if spec.workers > 1:
            data = (x, y, sw, validation_data)
            return self._fit_gang(outbox, job_id, attempt, spec, model, model_path, data, fit, memory)
        replicas = _replicas(model) if getattr(model, "distribute_strategy", None) is not None else 1
        if replicas > 1:
            batch = int(fit.get("batch_size") or 32)
            outbox.put(v.EV_LOG, placement_note(training_devices(), batch, x))
        tb_dir = Path(tempfile.mkdtemp(prefix="tb-", dir=self.workdir))

        def upload_checkpoint(path: Path, epoch: int) -> None:
            self._put_artifact(job_id, attempt, v.checkpoint_name(epoch), path)

        from .callbacks import EpochTensorBoard, EventCallback, Interrupted, LimitCheck
        from .fitframe import KeepFitFrame
        from .pipeline import EpochPipeline, shadow_loader
        from .usercallbacks import FileReturn, LineWriter, build_callbacks, snapshot

        multi_device = getattr(model, "distribute_strategy", None) is not None and _replicas(model) > 1
        loader = None if multi_device else shadow_loader(keras, model_path, spec.safe_mode, spec.compile, objects)
        scratch = Path(tempfile.mkdtemp(prefix="checkpoints-", dir=self.workdir))
        pipeline = EpochPipeline(outbox, model, loader, upload_checkpoint, scratch)
        files = FileReturn(scratch / "files")
        job_cwd = files.working_directory(spec.cwd)

        def send_files() -> None:
            """What the user's callbacks wrote since the last epoch goes back, before that epoch is reported; a job
            whose folder grew past its disk limit stops here."""
            self.limits.check_disk(self.workdir)
            for path, artifact, rel in files.changed():
                copy = snapshot(path, scratch / "outgoing")

                def upload(copy: Path = copy, artifact: str = artifact) -> None:
                    try:
                        self._put_artifact(job_id, attempt, artifact, copy)
                    finally:
                        copy.unlink(missing_ok=True)

                pipeline.call(upload)
                pipeline.event(v.EV_LOG, {"message": f"wrote {rel}", "file": artifact, "path": rel})

        events = EventCallback(
            outbox,
            pipeline,
            spec.fit.epochs,
            _samples(x),
            self.spot.notice if self.spot else None,
            at_epoch_end=send_files,
        )
        tensorboard = EpochTensorBoard(log_dir=str(tb_dir), write_graph=False, profile_batch=0)
        # The user's callbacks first, ours after them: an epoch's logs are reported once every callback has written
        # its keys into them (ReduceLROnPlateau's learning_rate), as the kernel's History, which Keras runs last, sees.
        callbacks = build_callbacks(spec.callbacks, files)
        keep = KeepFitFrame()
        callbacks += [LimitCheck(memory.check), tensorboard, events, keep]
        printed, errors = (
            LineWriter(
                lambda line, stream=stream: pipeline.event(
                    v.EV_LOG, {"message": files.to_kernel(line)[:MAX_LINE], "stream": stream}
                )
            )
            for stream in ("stdout", "stderr")
        )
        try:
            try:
                with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors), job_cwd:
                    (trial.fit_call(model) if trial is not None else model.fit)(
                        x, y, sample_weight=sw, validation_data=validation_data, callbacks=callbacks, verbose=0, **fit
                    )
                self._releasing = keep.release_in_background()
            except Interrupted:
                pass
            printed.flush()
            errors.flush()
            send_files()  # what was written as training ended (on_train_end)
            pipeline.drain()
        finally:
            tensorboard.close()  # a fit that raised never reached on_train_end
            pipeline.close()
            shutil.rmtree(scratch, ignore_errors=True)
        if outbox.cancel.is_set():
            return v.OUTCOME_CANCELED, None
        if events.resume_at is not None:
            return self._interrupted(outbox, events.resume_at)
        if trial is not None:  # the study reads the trial's hyperparameters (and what a HyperModel.fit returned)
            outbox.put(v.EV_LOG, trial.report_event())
        self._status(outbox, v.RETURNING)
        self._upload_model(model, job_id, attempt, "model.keras", spec.objects)
        for path in sorted(tb_dir.rglob("*")):
            if path.is_file():
                name = "tensorboard/" + path.relative_to(tb_dir).as_posix()
                self._put_artifact(job_id, attempt, name, path)
        return v.OUTCOME_COMPLETED, None

    def _fit_gang(
        self,
        outbox: Outbox,
        job_id: str,
        attempt: int,
        spec: JobSpec,
        model: Any,
        model_path: Path,
        data: tuple[Any, Any, Any, Any],
        fit: dict[str, Any],
        memory: MemoryWatch,
    ) -> tuple[str, str | None]:
        """The fit by `spec.workers` processes of this machine on Keras-on-JAX (gangrun.py); checkpoints, events and
        the returned model go as a one-process fit's do."""
        from .gangrun import GangJob, fit_in_gang, gang_data
        from .pipeline import EpochPipeline

        given = gang_data(*data, fit)
        job = GangJob(
            model_path=model_path,
            arrays=given.arrays,
            workers=spec.workers,
            batch_size=given.batch_size,
            epochs=spec.fit.epochs,
            initial_epoch=int(fit.get("initial_epoch") or 0),
            shuffle=given.shuffle,
            seed=spec.seed or 0,
            folder=Path(tempfile.mkdtemp(prefix="gang-", dir=self.workdir)),
            objects={name: ref.model_dump(by_alias=True, exclude_none=True) for name, ref in spec.objects.items()},
            safe_mode=spec.safe_mode,
            validation=given.validation,
            validation_batch_size=given.validation_batch_size,
            callbacks=tuple(c.model_dump(by_alias=True, exclude_unset=True) for c in spec.callbacks),
        )
        outbox.put(v.EV_LOG, {"message": f"training on {spec.workers} workers (Keras on JAX, data-parallel)"})

        def upload_checkpoint(path: Path, epoch: int) -> None:
            self._put_artifact(job_id, attempt, v.checkpoint_name(epoch), path)

        scratch = Path(tempfile.mkdtemp(prefix="checkpoints-", dir=self.workdir))
        pipeline = EpochPipeline(outbox, model, None, upload_checkpoint, scratch)
        try:
            ended = fit_in_gang(
                job,
                model,
                pipeline,
                outbox.cancel,
                len(given.arrays["x"]),
                check=memory.check,
                at_epoch_end=lambda: self.limits.check_disk(self.workdir),
            )
            pipeline.drain()
        finally:
            pipeline.close()
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(job.folder, ignore_errors=True)
        if not ended or outbox.cancel.is_set():
            return v.OUTCOME_CANCELED, None
        self._status(outbox, v.RETURNING)
        self._upload_model(model, job_id, attempt, "model.keras", spec.objects)
        return v.OUTCOME_COMPLETED, None

    def _interrupted(self, outbox: Outbox, resume_at: int) -> tuple[str, str]:
        """The machine is being reclaimed: every finished epoch's checkpoint is uploaded (the pipeline drained),
        so the job resumes elsewhere at `resume_at`; what ran of that epoch is dropped."""
        assert self.spot is not None
        message = f"{self.spot.describe()}: stopped at a batch boundary; the job resumes from epoch {resume_at}"
        outbox.put(v.EV_LOG, {"message": message})
        return v.SPOT_INTERRUPTED, message

    def _gear_up(self, outbox: Outbox, job_id: str, attempt: int, spec: JobSpec) -> Any:
        """Packages first (a cached per-requirements environment), then the user's own code, then the imports the
        model's custom objects need. What went in for this job comes out again in `_gear_down`."""
        if self.keras is None:
            import keras

            self.keras = keras
        from aibro_core.requirements import runtime_versions, version_mismatch

        from . import envs

        mine = runtime_versions()
        note = {"message": "worker: " + ", ".join(f"{k} {val}" for k, val in mine.items()), "versions": mine}
        warning = version_mismatch(spec.versions or {}, mine)
        if warning:
            note["warning"] = warning
        outbox.put(v.EV_LOG, note)
        requirements = spec.requirements or []
        if requirements:

            def report(line: str) -> None:
                outbox.put(v.EV_LOG, {"message": line, "stage": v.GEARING_UP_ENV})

            report(f"installing {', '.join(requirements)}")
            site = envs.ensure_env(requirements, self.env_cache, report, shared=_SharedEnvs(self, job_id, attempt))
            shadowed = envs.activate(site)
            self._active_env = True
            if shadowed:
                outbox.put(
                    v.EV_LOG,
                    {
                        "message": f"already loaded on the worker, kept at its own version: {', '.join(shadowed)}",
                        "warning": f"the worker keeps its own {', '.join(shadowed)} (already imported before the "
                        "job's requirements were installed); pin what the worker has, or leave them out",
                    },
                )
        arrays = spec.data.globals_
        if arrays:
            from .datatree import notebook_arrays

            sys.modules[GLOBALS_MODULE] = notebook_arrays(GLOBALS_MODULE, arrays, self.fetch_blob)
        code = spec.code
        if code is not None:
            from .usercode import UserCode

            self._code = UserCode(self.fetch_blob(code.blob), self.code_root)
            self._code.activate()
        for mod in spec.custom_modules:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as exc:
                raise RuntimeError(
                    f"the model uses {mod}, which is not installed on the worker: add it to the job's requirements "
                    f"(requirements=['{(exc.name or mod).split('.')[0]}'] or %%cloud_fit --requirements)"
                ) from None
        return self.keras

    def _gear_down(self) -> None:
        sys.modules.pop(GLOBALS_MODULE, None)
        if self._code is not None:
            self._code.deactivate()
            self._code = None
        if self._active_env:
            from . import envs

            envs.deactivate()
            self._active_env = False

    def _load_model(
        self, keras: Any, path: Path, safe_mode: bool, compile_args: dict | None, objects: dict[str, Any]
    ) -> Any:
        """The model, under MirroredStrategy when this machine has several devices: its GPUs, or the logical CPU
        devices AIBRO_CPU_DEVICES made (see `split_cpu`)."""
        from .pipeline import load_job_model

        devices = training_devices()
        if len(devices) > 1:
            import tensorflow as tf

            with tf.distribute.MirroredStrategy(devices=devices).scope():
                return load_job_model(keras, path, safe_mode, compile_args, objects)
        return load_job_model(keras, path, safe_mode, compile_args, objects)

    # -- transfers --------------------------------------------------------------------------------
    def fetch_blob(self, sha: str) -> Path:
        """A content-addressed cache: a warm worker never downloads the same data twice."""
        dest = self.cache / sha
        if dest.exists():
            return dest
        tmp = dest.with_suffix(".part")
        digest = self._download(f"/worker/blobs/{sha}", tmp, "blob")
        if digest != sha:
            tmp.unlink()
            raise RuntimeError(
                f"blob {sha} arrived corrupted (its bytes do not hash to its name): submit the job again; the "
                "backend then asks for those bytes again"
            )
        os.replace(tmp, dest)
        return dest

    def fetch_earlier_model(self, job_id: str, epoch: int | None = None) -> Path:
        """The earlier study trial this one resumes: its checkpoint at `epoch`, else its trained model (the backend
        allows that one file of that one job)."""
        dest = self.workdir / "earlier.keras"
        name = "model.keras" if epoch is None else v.checkpoint_name(epoch)
        self._download(f"/worker/jobs/{job_id}/artifacts/{name}", dest, "earlier trial's model")
        return dest

    def fetch_artifact(self, job_id: str, name: str) -> Path:
        dest = self.workdir / "resume.keras"
        self._download(f"/worker/jobs/{job_id}/artifacts/{name}", dest, "artifact")
        return dest

    def _download(self, path: str, dest: Path, what: str) -> str:
        """Stream `path` into `dest` piece by piece (never whole in memory); a connection that breaks mid-way, or S3
        failing for now where the backend keeps bytes there (a 5xx after its redirect), is tried again from the
        start for up to S3_RETRY_S. Returns the sha256 of what was written."""

        def once() -> str:
            resp = retrying(lambda: self.t.request("GET", path, stream=True), what)
            h = hashlib.sha256()
            with resp, open(dest, "wb") as f:
                for chunk in resp.iter_content(1 << 20):
                    h.update(chunk)
                    f.write(chunk)
            return h.hexdigest()

        def again(exc: Exception, attempt: int) -> None:
            log.info("%s download broke off (%s); starting it again", what, exc)

        try:  # a backend that stays away was waited for in `once` (`retrying`)
            return backoff.retry(once, retry_on=broke_off, within_s=S3_RETRY_S, backoff=backoff.S3_PART, on_retry=again)
        except requests.RequestException as exc:
            raise BackendUnreachable(f"the {what} download kept breaking off for {S3_RETRY_S:g} s: {exc}") from None

    def _upload_model(self, model: Any, job_id: str, attempt: int, name: str, objects: dict[str, ObjectRef]) -> None:
        """The trained model as a .keras file that says which weights each optimizer steps and what the model
        names, so the kernel (or a later job) loads it whole."""
        from aibro_core.kerasfile import keras_notes_quiet, note, note_optimizers

        with tempfile.TemporaryDirectory(dir=self.workdir) as d:
            path = Path(d) / "model.keras"
            with keras_notes_quiet():
                model.save(path)
            note_optimizers(model, path)
            note(path, "objects", {n: ref.model_dump(mode="json", exclude_none=True) for n, ref in objects.items()})
            self._put_artifact(job_id, attempt, name, path)

    def _put_artifact(self, job_id: str, attempt: int, name: str, source: Path) -> None:
        """Upload a file in chunks of UPLOAD_CHUNK (so a checkpoint of any size up to the job's data limit goes,
        however small the backend's limit per request), resuming from what the backend holds when a chunk's
        connection breaks: HEAD says how many bytes arrived. A backend keeping bytes in S3 says so on that HEAD
        (X-Upload-Via: s3, asked once): the file then goes on its presigned URLs (aibro_core.presigned)."""
        url = f"/worker/jobs/{job_id}/artifacts/{name}"
        if self._s3_uploads is None:
            head = retrying(lambda: self.t.request("HEAD", url, params={"attempt": attempt}), "upload")
            self._s3_uploads = head.headers.get("X-Upload-Via") == "s3"
        if self._s3_uploads:
            to = f"/worker/jobs/{job_id}/uploads/{name}"
            retrying(lambda: upload_file_via_s3(self.t, to, source, attempt=attempt), "upload")
            return
        total = source.stat().st_size
        offset = 0
        with open(source, "rb") as f:

            def send() -> dict[str, Any]:
                f.seek(offset)
                chunk = f.read(UPLOAD_CHUNK)
                params = {"attempt": attempt, "offset": offset, "total": total}
                return self.t.json("PUT", url, params=params, data=chunk)

            def failed(exc: Exception, n: int) -> None:
                nonlocal offset  # the next try goes on from what the backend holds
                head = retrying(lambda: self.t.request("HEAD", url, params={"attempt": attempt}), "upload")
                offset = int(head.headers.get("X-Received", "0"))

            while True:
                reply = backoff.retry(send, retry_on=_resumable, attempts=UPLOAD_TRIES + 1, on_retry=failed)
                if reply.get("complete"):
                    return
                offset = int(reply["received"])


def _resumable(exc: BaseException) -> bool:
    """An artifact chunk's failure after which the upload goes on from what the backend holds."""
    return isinstance(exc, BackendUnreachable) or (
        isinstance(exc, ApiError) and exc.status == 409 and ("resume from" in str(exc) or "in progress" in str(exc))
    )


class _SharedEnvs:
    """envs.Shared through this backend: the environments the user's other machines built (GET /worker/envs/KEY),
    and one built here uploaded as the assigned job's artifact envs/KEY.zip."""

    def __init__(self, worker: Worker, job_id: str, attempt: int) -> None:
        self.worker, self.job_id, self.attempt = worker, job_id, attempt

    def fetch(self, key: str, dest: Path) -> bool:
        try:
            self.worker._download(f"/worker/envs/{key}", dest, "environment")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def offer(self, key: str, source: Path) -> None:
        self.worker._put_artifact(self.job_id, self.attempt, f"envs/{key}.zip", source)


def split_cpu(settings: WorkerSettings) -> None:
    """AIBRO_CPU_DEVICES=N (N > 1) splits the CPU into N logical devices before TensorFlow starts, so a machine with
    no GPU trains under MirroredStrategy as one with N GPUs does (how the suite proves the multi-device path)."""
    count = settings.cpu_devices
    if count > 1:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError as exc:  # TensorFlow already started (a spare worker warmed it up): one device then
            log.warning("cannot split the CPU into %d devices: %s", count, exc)


def placement_note(devices: list[str], batch: int, x: Any) -> dict[str, Any]:
    """What the user sees of a multi-device fit: the devices, and how each batch splits across them."""
    names = ", ".join(d.rsplit("/", 1)[-1].replace("device:", "") for d in devices)
    n = len(devices)
    if hasattr(x, "element_spec"):  # a dataset: its own batches split
        return {
            "message": f"MirroredStrategy over {n} devices ({names}): each batch of the dataset splits {n} ways",
            "replicas": n,
        }
    return {
        "message": f"MirroredStrategy over {n} devices ({names}): each batch of {batch} splits into "
        f"{batch // n} per device",
        "replicas": n,
        "replica_batch": batch // n,
    }


def ready_note(seconds: dict[str, float]) -> dict[str, Any]:
    """The log event that says where a job's start went on the worker, before its TRAINING status (issue 40): its
    data (fetched, or found in the warm worker's cache), its model built by a study's build function, loaded."""
    names = {"data": "data", "build": "model built", "load": "model loaded"}
    said = ", ".join(f"{names[k]} {s:.2f} s" for k, s in seconds.items())
    return {"message": f"ready to train: {said}", "timings": {k: round(s, 4) for k, s in seconds.items()}}


def training_devices() -> list[str]:
    """The devices one job trains on: every GPU, else every logical CPU device (one unless split_cpu split it)."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def _replicas(model: Any) -> int:
    return int(getattr(model.distribute_strategy, "num_replicas_in_sync", 1))


def _samples(x: Any) -> int | None:
    first = x
    while isinstance(first, (list, tuple)):
        first = first[0] if first else None
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    return int(first.shape[0]) if hasattr(first, "shape") else None


def worker_token(url: str, settings: WorkerSettings, workdir: Path) -> str:
    """The per-instance token: AIBRO_WORKER_TOKEN when given (the local provider); else the one kept in
    AIBRO_WORKER_TOKEN_FILE (default <workdir>/worker-token) by an earlier boot; else the one that the one-time
    AIBRO_ENROLL_TOKEN (a cloud machine's user data) buys from POST /worker/enroll, kept there (0600) so a
    restart after stop/start reuses it."""
    if settings.worker_token:
        return settings.worker_token
    token_file = settings.worker_token_file or workdir / "worker-token"
    try:
        kept = token_file.read_text().strip()
    except OSError:
        kept = ""
    if kept:
        return kept
    enroll = settings.enroll_token
    if not enroll:
        raise SystemExit("no worker token: set AIBRO_WORKER_TOKEN, or AIBRO_ENROLL_TOKEN to enroll")
    t = Transport(url, enroll, timeout=60)
    t.session.headers[version.HEADER] = version.agent_version()
    answer = retrying(lambda: t.json("POST", "/worker/enroll", json={}), "enroll")
    write_private(token_file, answer["token"])
    log.info("enrolled as %s; token kept in %s", answer["instance_id"], token_file)
    return str(answer["token"])


def main() -> None:
    os.umask(0o077)  # what the job writes here (logs, checkpoints, caches) is private, however this was started
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("agent %s", version.agent_version())  # of the code this process loaded
    for note in KERAS_NOTES:  # what the agent deals with itself is not the job's stderr (the user's cell)
        warnings.filterwarnings("ignore", message=re.escape(note))
    settings = WorkerSettings.from_env()
    if not settings.worker_url:
        raise SystemExit("no backend to work for: set AIBRO_WORKER_URL")
    url, instance_id = settings.worker_url, settings.instance_id
    workdir = settings.worker_dir or Path(tempfile.mkdtemp(prefix="aibro-worker-"))
    netbridge.to_backend(url)  # a sandbox without a network of its own reaches the backend through its socket
    try:
        token = worker_token(url, settings, workdir)
    except AuthError as exc:
        log.error("cannot enroll: %s", exc)
        raise SystemExit(3) from None
    except BackendUnreachable as exc:
        log.error("cannot enroll: %s", exc)
        shutdown_if_asked()
        raise SystemExit(4) from None
    split_cpu(settings)
    become_subreaper()
    limits = settings.job_limits()
    limits.apply()
    worker = Worker(url, token, instance_id, workdir, limits)
    worker.run()
    if worker.backend_lost:
        shutdown_if_asked()


def shutdown_if_asked() -> None:
    """On a cloud machine (AIBRO_SHUTDOWN_ON_LOSS=1) a backend gone for BACKEND_GONE_S means nobody will ever stop
    this machine: shut it down (on-demand ones stop, spot ones terminate: their shutdown behaviour)."""
    settings = WorkerSettings.from_env()
    if not settings.shutdown_on_loss:
        return
    command = shlex.split(settings.shutdown_command)
    log.error("the backend was unreachable for %.0f s: shutting this machine down (%s)", BACKEND_GONE_S, command[0])
    try:
        subprocess.run(command, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("cannot shut down: %s", exc)
