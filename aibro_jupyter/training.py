"""`Training.online_fit` and friends: the seed product's Python API on top of the client and the bundle."""

from __future__ import annotations

import json
import numbers
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError as Invalid

from aibro_core import vocabulary as v
from aibro_core.bounds import MAX_EPOCHS
from aibro_core.compat import keras as keras_compat
from aibro_core.kerasfile import keras_notes_quiet
from aibro_core.models import Data, Job, JobSpec, Machine, Prediction, explain
from aibro_core.requirements import runtime_versions

from . import bundle as b
from .blobsource import BytesSource
from .checks import check_before_upload, fit_batch_size
from .client import BackendClient
from .config import resolve, say_once_unconfined, start_embedded
from .dataset_blob import from_pydataset, is_dataset, is_pydataset
from .errors import ApiError, JobFailed, ValidationError
from .filereturn import FilesBack
from .fitrequest import FitRequest
from .gangcheck import check_model_code, check_workers
from .kerasnames import attached_objects, keras_configs, plan_names
from .modelprofile import model_profile
from .predictions import effective_batch_size, format_predictions, prediction_request
from .prices import hourly
from .progress import JobView, TextProgress
from .rebuildplan import plan_callbacks, plan_compile
from .travel import build_name, plan_code, requirements_from, warn_missing_requirements

Watcher = Callable[[JobView, dict[str, Any]], None]


def connect() -> BackendClient:
    """A client for the configured backend, or the embedded one (started on first use, and started again by the
    client when it dies: a fit that is following its job says so and carries on)."""
    target = resolve()
    restart = start_embedded if target.embedded else None
    client = BackendClient(target.url, target.token, restart=restart, ca_bundle=target.ca_bundle)
    health = client.health()
    if target.embedded and health.sandbox == "none":
        say_once_unconfined()
    return client


def _machine_list(machine_ids: str | list[str] | None, offers: list[Machine]) -> list[str]:
    known = [o.machine_id for o in offers]
    if machine_ids is None or machine_ids == []:
        return [known[0]]
    ids = [m.strip() for m in machine_ids.split(",")] if isinstance(machine_ids, str) else list(machine_ids)
    for m in ids:
        if m not in known:
            raise ValidationError(f"unknown machine '{m}': available machines are {known} (see available_machines())")
    return ids


def _check_epochs(epochs: Any) -> int:
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs <= 0:
        raise ValidationError(f"epochs must be a positive integer, got {epochs!r}")
    if epochs > MAX_EPOCHS:
        raise ValidationError(f"epochs is at most {MAX_EPOCHS} on the backend, got {epochs}: train fewer epochs")
    return int(epochs)


def _check_fit_kwargs(fit_kwargs: dict[str, Any]) -> None:
    allowed = set(v.FIT_KWARGS) | {"callbacks", "sample_weight", "verbose"}
    bad = sorted(set(fit_kwargs) - allowed)
    if bad:
        raise ValidationError(f"fit arguments {bad} are not supported remotely; supported: {sorted(allowed)}")


def _pydatasets_as_datasets(x: Any, y: Any, validation_data: Any) -> tuple[Any, Any]:
    """A keras.utils.PyDataset for x or validation_data becomes the tf.data.Dataset of its batches (dataset_blob)."""
    if is_pydataset(x):
        if y is not None:
            raise ValidationError(
                "x is a keras.utils.PyDataset, so y must come from it, not be passed beside it: make __getitem__ "
                "return (inputs, targets)"
            )
        x = from_pydataset(x, "x")
    if is_pydataset(validation_data):
        validation_data = from_pydataset(validation_data, "validation_data")
    return x, validation_data


def _steps(value: Any) -> int | None:
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0 else None


def _plain(value: Any) -> Any:
    """A fit argument as JSON carries it: NumPy's integers and floats (np.int64(5) steps) as Python's."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(val) for val in value]
    if isinstance(value, dict):
        return {k: _plain(val) for k, val in value.items()}
    return value


def _profile(model: Any, x: Any, batch_size: int | None) -> dict[str, Any] | None:
    """The model's profile the job keeps for later predictions of the same model (modelprofile.py), as it travels;
    None, and the fit goes on, for a model whose layers it cannot read (a prediction is worth less than the fit)."""
    try:
        return model_profile(model, x, effective_batch_size(batch_size, x)).model_dump(mode="json")
    except Exception as exc:  # noqa: BLE001 - a layer's own get_config or shapes; the fit itself does not need them
        warnings.warn(
            f"this job will not teach later predictions: its model could not be profiled ({exc})", stacklevel=3
        )
        return None


def job_spec(**fields: Any) -> JobSpec:
    """The backend's own JobSpec made of `fields` as they travel: through JSON, as the backend reads them (a tuple is
    a list there, a class weight's key a string, NumPy's numbers cannot go), so a spec the backend would refuse is
    refused before a byte is uploaded, in the backend's words, and the model sent is the one checked."""
    try:
        text = json.dumps(fields, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"the job spec cannot travel as JSON: {exc}") from None
    try:
        return JobSpec.model_validate_json(text)
    except Invalid as exc:
        raise ValidationError(explain(exc, "the job spec")) from None


def uploaded(spec: JobSpec, bundle: b.Bundle) -> JobSpec:
    """`spec` as `prepare` checked it, a stand-in name for each blob its upload names, with the names the upload
    gave them (`bundle.upload` has put them into `bundle.data`)."""
    return spec.model_copy(update={"data": Data.model_validate_json(json.dumps(bundle.data))})


def kernel_seed() -> int | None:
    """The seed of the kernel's keras.utils.set_random_seed, if it was called: the worker sets it again just before
    fit, so fit's shuffling draws what it draws here (the weights, dropout's state included, travel in the model)."""
    seed = keras_compat.random_seed()
    return seed if isinstance(seed, int) and 0 <= seed < 2**32 else None


def history_from(view: JobView, params: dict[str, Any], model: Any = None) -> Any:
    import keras

    hist = keras.callbacks.History()
    hist.history = view.keras_lists()
    hist.epoch = sorted(view.history)
    hist.params = params
    if model is not None:
        hist.set_model(model)
        model.history = hist  # as Keras' own fit leaves it (History.on_epoch_end), for `model.history.history[...]`
    return hist


class Training:
    """Train a Keras model on a remote machine: submit, watch live, and get the trained model back."""

    def __init__(self, client: BackendClient | None = None) -> None:
        self._client = client

    @property
    def client(self) -> BackendClient:
        if self._client is None:
            self._client = connect()
        return self._client

    # -- submit -----------------------------------------------------------------------------------
    def submit(self, request: FitRequest) -> Job:
        """Validate everything, upload what the backend lacks, and create the job; returns the job."""
        bundle, spec = self.prepare(request)
        try:
            bundle.upload(self.client)
            return self._create(
                uploaded(spec, bundle), request.wait_new_job_create_s, request.wait_new_job_create_interval
            )
        finally:
            shutil.rmtree(bundle.workdir, ignore_errors=True)

    def prepare(self, request: FitRequest) -> tuple[b.Bundle, JobSpec]:
        """Every check and everything written locally (the saved model, datasets, the code blob), nothing sent:
        the bundle to upload and the job spec that names it, checked with a stand-in name for each blob the upload
        names (`uploaded` puts the real ones in). The caller removes `bundle.workdir`. With
        `request.build` (a search's build function, search.py), `request.model` is one it built, checked against
        the data but not sent: the function travels as code instead and the spec's `trial` names it; with
        `request.hypermodel_fit` (a HyperModel whose own fit trains the model: it may prepare the data, or
        compile, itself) neither the data nor the compile is checked against that model."""
        model, train_Y, build, hypermodel_fit = request.model, request.train_Y, request.build, request.hypermodel_fit
        fit_kwargs = dict(request.fit_kwargs or {})
        _check_fit_kwargs(fit_kwargs)
        check_workers(request)
        shuffle_batches = is_pydataset(request.train_X) and bool(fit_kwargs.get("shuffle", True))
        train_X, validation_data = _pydatasets_as_datasets(request.train_X, train_Y, request.validation_data)
        # arguments, then size from nbytes, then shapes/labels/NaN: before any byte is written
        check_before_upload(self.client.policy, replace(request, train_X=train_X, validation_data=validation_data))
        epochs = _check_epochs(fit_kwargs.pop("epochs", request.epochs))
        b.check_model(model, request.safe_mode, compiled=not hypermodel_fit)
        if is_dataset(train_X) and fit_kwargs.get("validation_split"):
            raise ValidationError(
                "validation_split cannot split a tf.data.Dataset: pass validation_data=another dataset instead, "
                "e.g. ds.take(n) for validation and ds.skip(n) for training"
            )
        batch_size = fit_batch_size(request.batch_size, "batch_size", train_X)
        if fit_kwargs.get("validation_batch_size") is not None:
            held_out = validation_data[0] if isinstance(validation_data, (tuple, list)) and validation_data else None
            fit_kwargs["validation_batch_size"] = fit_batch_size(
                fit_kwargs["validation_batch_size"], "validation_batch_size", held_out
            )
        reqs = requirements_from(request.requirements, (request.argnames or {}).get("requirements", "requirements"))
        travelling = plan_callbacks(fit_kwargs.pop("callbacks", None))
        compile_args = plan_compile(model, travelling)
        for note in travelling.notes:
            warnings.warn(note, stacklevel=3)
        if not hypermodel_fit:
            b.build_from_data(model, train_X)
        names = plan_names(model, extra=keras_configs(travelling.specs, compile_args))
        check_model_code(request.workers, names.travel, (request.argnames or {}).get("workers", "workers"))
        code = plan_code(names.travel + travelling.objects + ([build] if build is not None else []))
        warn_missing_requirements(code, reqs)
        machines = _machine_list(request.machine_ids, self.client.machines())
        limit = self.client.policy().max_job_bytes
        bundle = b.new_bundle()
        try:
            b.encode_data(
                bundle,
                train_X,
                train_Y,
                fit_kwargs.pop("sample_weight", None),
                validation_data,
                None if hypermodel_fit else model,
                (_steps(fit_kwargs.get("steps_per_epoch")), _steps(fit_kwargs.get("validation_steps"))),
                epochs - int(fit_kwargs.get("initial_epoch") or 0),
                shuffle_batches,
            )
            if code.arrays:  # what the notebook's definitions read, loaded on the worker before their module
                bundle.data["globals"] = {
                    name: b.encode_tree(arr, name, bundle)[0] for name, arr in code.arrays.items()
                }
            fit_kwargs.pop("verbose", None)
            if "class_weight" in fit_kwargs and fit_kwargs["class_weight"] is not None:
                fit_kwargs["class_weight"] = {int(k): float(w) for k, w in fit_kwargs["class_weight"].items()}
            data_bytes = bundle.total_bytes
            if data_bytes > limit:
                raise ValidationError(
                    f"this job's data is {data_bytes} bytes, over the {limit}-byte limit per job: "
                    "train on a sample, or use lower precision (float32/uint8)"
                )
            if build is None:
                b.save_model(model, bundle, names, request.safe_mode)
            code_spec = None
            if code.files:
                code_spec = {"blob": bundle.add(BytesSource(code.blob(), "code")), "modules": code.modules}
                code_spec["files"] = code.listing()
            if bundle.total_bytes > limit:
                raise ValidationError(
                    f"this job's model and data are {bundle.total_bytes} bytes, over the {limit}-byte limit per job: "
                    "use a smaller model or less data, or raise the limit (AIBRO_MAX_JOB_BYTES) on the backend"
                )
        except BaseException:
            shutil.rmtree(bundle.workdir, ignore_errors=True)
            raise
        fit = {"epochs": epochs, **{k: _plain(val) for k, val in fit_kwargs.items()}}
        if batch_size is not None:
            fit["batch_size"] = batch_size
        trial = {"build": build_name(build), "hyperparameters": {}, "values": {}} if build is not None else None
        try:
            spec = job_spec(
                **({"model": bundle.model_sha} if trial is None else {"trial": trial}),  # a trial's model is built
                safe_mode=request.safe_mode,
                custom_modules=sorted(code.installed),
                code=code_spec,
                requirements=reqs,
                versions=runtime_versions(),
                data=b.with_stand_ins(bundle.data),
                fit=fit,
                callbacks=travelling.specs,
                machines=machines,
                description=request.description,
                cool_down_s=request.cool_down_period_s,
                wait_request_s=request.wait_request_s,
                record=request.record,
                meta=request.meta or {},
                seed=kernel_seed(),
                **({"workers": request.workers} if request.workers > 1 else {}),
                compile=compile_args,
                objects=names.refs,
                cwd=str(Path.cwd()),
                profile=_profile(model, train_X, batch_size) if build is None and not hypermodel_fit else None,
            )
        except BaseException:
            shutil.rmtree(bundle.workdir, ignore_errors=True)
            raise
        return bundle, spec

    def _create(self, spec: JobSpec, wait_s: float, interval: float) -> Job:
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                return self.client.submit(spec)
            except ApiError as exc:
                if exc.status != 429 or time.monotonic() >= deadline:
                    raise
                print(f"waiting for a job slot: {exc}", file=sys.stderr, flush=True)
                time.sleep(max(0.1, interval))

    # -- watch ------------------------------------------------------------------------------------
    def watch(self, job_id: str, watchers: list[Watcher] | None = None, after: int = 0) -> JobView:
        """Follow a job's events from `after` until it is final, feeding each to the watchers."""
        view = JobView(job_id)
        files = FilesBack(self.client, job_id)  # what the job's callbacks write comes back as it is written
        for ev in self.client.follow(job_id, after):
            view.apply(ev)
            files(view, ev)
            for w in watchers or []:
                w(view, ev)
        return view

    def collect(
        self,
        view: JobView,
        model: Any = None,
        safe_mode: bool = True,
        directory_to_save_ckpt: str | None = None,
        directory_to_save_log: str | None = None,
    ) -> tuple[Any, Any]:
        """After a job ends: the trained model (into `model` in place if given) and its History."""
        if view.status != v.COMPLETED:
            why = view.errors[-1] if view.errors else "it was canceled"
            raise JobFailed(f"job {view.job_id} did not complete: {why}")
        with tempfile.TemporaryDirectory(prefix="aibro-result-") as d:
            path = self.client.download_artifact(view.job_id, "model.keras", Path(d) / "model.keras")
            if model is None:
                import keras

                objects = attached_objects(path)
                with keras_notes_quiet():
                    model = keras.saving.load_model(path, custom_objects=objects, safe_mode=safe_mode)
            else:
                b.load_into(model, path, plan_names(model).local, safe_mode)
        if directory_to_save_ckpt:
            for art in self.client.artifacts(view.job_id):
                if art.name.startswith("checkpoints/"):
                    self.client.download_artifact(
                        view.job_id, art.name, Path(directory_to_save_ckpt) / view.job_id / art.name
                    )
        if directory_to_save_log:
            self.get_tensorboard_logs(view.job_id, directory_to_save_log)
        params = {"epochs": view.epochs}
        if view.last_batch and view.last_batch.get("steps"):
            params["steps"] = int(view.last_batch["steps"])  # what a local fit's History.params says too
        return model, history_from(view, params, model)

    # -- the seed API -----------------------------------------------------------------------------
    @classmethod
    def online_fit(
        cls,
        model: Any,
        train_X: Any,
        train_Y: Any = None,
        machine_ids: str | list[str] | None = None,
        batch_size: int | None = None,
        epochs: int = 1,
        validation_data: Any = None,
        description: str = "",
        cool_down_period_s: float = 0,
        fit_kwargs: dict[str, Any] | None = None,
        directory_to_save_ckpt: str | None = None,
        directory_to_save_log: str | None = None,
        wait_request_s: float = 60,
        wait_new_job_create_s: float = 0,
        wait_new_job_create_interval: float = 5,
        record: bool = True,
        safe_mode: bool = True,
        verbose: bool = True,
        requirements: list[str] | str | None = None,
        workers: int = 1,
    ) -> tuple[str, Any, Any]:
        """Train `model` remotely; returns (job_id, trained_model, history). The trained weights and optimizer
        state land in the same `model` object. Ctrl-C detaches: the job goes on, `Training.attach` resumes.
        `workers` > 1 trains it on that many workers together, data-parallel (Keras on JAX; see the README)."""
        request = FitRequest.of_call(locals())  # every argument a FitRequest has, by name
        self = cls()
        job = self.submit(request)
        job_id = job.job_id
        if verbose:
            print(f"[{job_id}] submitted to {', '.join(job.machines)}", flush=True)
        try:
            view = self.watch(job_id, [TextProgress()] if verbose else [])
        except KeyboardInterrupt:
            print(f"\nDetached; {job_id} keeps training. Attach with Training.attach('{job_id}', model)", flush=True)
            raise
        trained, history = self.collect(view, model, safe_mode, directory_to_save_ckpt, directory_to_save_log)
        if verbose and history.history:
            last = {k: vals[-1] for k, vals in history.history.items()}
            print(f"[{job_id}] done: " + " - ".join(f"{k}: {val:.4f}" for k, val in last.items()), flush=True)
        return job_id, trained, history

    @classmethod
    def predict(
        cls,
        model: Any,
        train_X: Any,
        train_Y: Any = None,
        machine_ids: str | list[str] | None = None,
        batch_size: int | None = None,
        epochs: int = 1,
        fit_kwargs: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> list[Prediction]:
        """Before `online_fit`: the fit's predicted training time and cost on each machine (those of `machine_ids`,
        or every one offered), each from the best source the backend has (earlier jobs of this model on that
        machine type, else its FLOPs as a rough guess; nothing known: no numbers). Prints them as a table."""
        return cls().predictions(FitRequest.of_call(locals()), verbose)

    def predictions(self, request: FitRequest, verbose: bool = True) -> list[Prediction]:
        """`predict` for a fit already described (the magic's)."""
        offers = self.client.machines() if request.machine_ids else []
        machines = _machine_list(request.machine_ids, offers) if request.machine_ids else None
        predictions = self.client.predict(prediction_request(request, machines))
        if verbose:
            print(format_predictions(predictions), flush=True)
        return predictions

    @classmethod
    def online_search(
        cls,
        tuner: Any,
        train_X: Any,
        train_Y: Any = None,
        machine_ids: str | list[str] | None = None,
        parallel: int = 1,
        batch_size: int | None = None,
        epochs: int | None = None,
        validation_data: Any = None,
        description: str = "",
        fit_kwargs: dict[str, Any] | None = None,
        requirements: list[str] | str | None = None,
        cool_down_period_s: float = 0,
        verbose: bool = True,
    ) -> tuple[str, Any]:
        """Run a KerasTuner tuner's search remotely: each trial is a job on `machine_ids`, up to `parallel` at
        once, driven by the backend (the study goes on without this kernel); `cool_down_period_s` keeps a machine
        warm for the next trial. Returns (study_id, the best trial's trained model)."""
        from .search import follow_to_end, given_args, start_study

        request = FitRequest.of_call(  # each trial's model is the tuner's; an epochs not given is fit's default
            locals(), model=None, epochs=1 if epochs is None else epochs
        )
        given = given_args(request) - ({"epochs"} if epochs is None else set())  # a HyperModel's own fit gets none
        training = cls()
        study_id = start_study(training, tuner, request, parallel=parallel, verbose=verbose, search_args=given)
        return study_id, follow_to_end(training, tuner, study_id, verbose)

    @classmethod
    def attach_study(cls, study_id: str, tuner: Any = None, verbose: bool = True) -> Any:
        """Follow a study (started from another kernel, or before this one restarted) to its end: every trial so
        far, then the rest as they end; its results go into `tuner` when given; returns the best trial's model."""
        from .search import follow_to_end

        return follow_to_end(cls(), tuner, study_id, verbose)  # one that ended FAILED raises, as from the cell

    @classmethod
    def attach(cls, job_id: str, model: Any = None, verbose: bool = True, safe_mode: bool = True) -> tuple[Any, Any]:
        """Rebuild a job's progress from its full event history, follow it live, and return (model, history)."""
        self = cls()
        view = self.watch(job_id, [TextProgress()] if verbose else [])
        return self.collect(view, model, safe_mode)

    @classmethod
    def available_machines(cls, verbose: bool = True) -> list[dict[str, Any]]:
        """The marketplace: every machine the backend can start, with GPU, vCPU, memory and price; each a dict as
        the backend sends it, as this documented call has always returned them."""
        offers = cls().client.machines()
        if verbose:
            print(format_machines(offers), flush=True)
        return [o.model_dump(mode="json", exclude_unset=True) for o in offers]

    @classmethod
    def get_tensorboard_logs(cls, job_id: str, directory: str = ".") -> Path:
        """Download a job's TensorBoard logs into `{directory}/logs/{job_id}/`."""
        self = cls()
        dest = Path(directory) / "logs" / job_id
        for art in self.client.artifacts(job_id):
            if art.name.startswith("tensorboard/"):
                self.client.download_artifact(job_id, art.name, dest / art.name.removeprefix("tensorboard/"))
        return dest

    @classmethod
    def replay_job(
        cls, job_id: str, machine_ids: str | list[str] | None = None, verbose: bool = True
    ) -> tuple[str, Any, Any]:
        """Run a recorded job again with the same model, data and fit arguments; returns like online_fit."""
        self = cls()
        overrides: dict[str, Any] = {}
        if machine_ids:
            overrides["machines"] = _machine_list(machine_ids, self.client.machines())
        job = self.client.replay(job_id, **overrides)
        new_id = job.job_id
        if verbose:
            print(f"[{new_id}] replaying {job_id}", flush=True)
        view = self.watch(new_id, [TextProgress()] if verbose else [])
        model, history = self.collect(view)
        return new_id, model, history

    @classmethod
    def plot_timeline(cls, job_id: str, chart_type: str = "pie") -> Any:
        """A bqplot pie or funnel of the time the job spent in each substatus, from its timestamps."""
        from .widgets.timeline import timeline_chart

        return timeline_chart(cls().client.job(job_id).timeline, chart_type)

    @classmethod
    def cancel(cls, job_id: str) -> dict[str, Any]:
        """Ask the backend to cancel the job; the job as it answers, a dict as this documented call returns it."""
        return cls().client.cancel(job_id).model_dump(mode="json")

    @classmethod
    def job_history(cls, job_id: str) -> dict[str, Any]:
        """The job's history.json artifact (continuous across worker restarts)."""
        self = cls()
        with tempfile.TemporaryDirectory() as d:
            path = self.client.download_artifact(job_id, "history.json", Path(d) / "h.json")
            return json.loads(path.read_text())


def format_machines(offers: list[Machine]) -> str:
    head = f"{'machine_id':<16} {'provider':<8} {'gpu':<22} {'vcpus':>5} {'mem GiB':>8} {'$/h':>8} {'avail':<10}"
    rows = [head, "-" * len(head)]
    for o in offers:
        gpu = f"{o.gpu_count}x {o.gpu_type}" if o.gpu_count else "-"
        rows.append(
            f"{o.machine_id:<16} {o.provider:<8} {gpu:<22} {o.vcpus:>5} {o.memory_gib:>8} "
            f"{hourly(o.price_per_hour):>8} {o.availability:<10}"
        )
    return "\n".join(rows)


available_machines = Training.available_machines
get_tensorboard_logs = Training.get_tensorboard_logs
replay_job = Training.replay_job
plot_timeline = Training.plot_timeline
