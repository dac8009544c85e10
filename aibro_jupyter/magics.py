"""IPython magics: %%cloud_fit runs a cell's one `.fit(...)` on a remote machine and everything else locally.

`%load_ext aibro_jupyter` registers %%cloud_fit, %cloud_machines, %cloud_jobs, %cloud_attach, %cloud_result,
%cloud_cancel and %cloud_timeline."""

from __future__ import annotations

import ast
import inspect
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from aibro_core import vocabulary as v
from aibro_core.models import Job, Prediction, Study

from .cellfits import CellFits
from .cellsplit import FitInBlock, SplitCell, fit_cell, split_cell
from .cellwait import awaitable_magics, run_async, run_sync, until
from .errors import AibroError, ValidationError
from .fitrequest import FitRequest
from .progress import JobView, TextProgress, local_notice, printed, worker_note
from .timeline_table import JOBS_HEAD, format_timelines, job_row
from .training import Training, format_machines


@magics_class
class CloudMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.default_machines: list[str] | None = None
        self.default_cool_down: float | None = None
        self._trainer: Training | None = None
        self.last_panel: Any = None

    @property
    def trainer(self) -> Training:
        if self._trainer is None:
            self._trainer = Training()
        return self._trainer

    # -- %%cloud_fit --------------------------------------------------------------------------------
    @magic_arguments()
    @argument("--machine", "-m", default=None, help="ordered machine list, e.g. g4dn.xlarge,g4dn.xlarge.od")
    @argument("--cool-down", type=float, default=None, help="seconds to keep the machine warm afterwards")
    @argument("--wait-request", type=float, default=60, help="seconds to wait for a machine before the next one")
    @argument("--wait-slot", type=float, default=0, help="seconds to wait for a job slot when at the limit")
    @argument("--description", "-d", default="", help="a note shown in job lists")
    @argument("--detach", action="store_true", help="start the job and return at once; attach later")
    @argument("--ckpt-dir", default=None, help="download per-epoch checkpoints here when done")
    @argument("--log-dir", default=None, help="download TensorBoard logs to DIR/logs/JOB when done")
    @argument("--into", default=None, help="variable that receives the trained model (default: the receiver)")
    @argument("--no-record", action="store_true", help="do not keep the job for replay")
    @argument("--unsafe", action="store_true", help="load the model with safe_mode=False (Lambda layers)")
    @argument(
        "--requirements",
        "-r",
        default=None,
        help="packages the worker installs: a requirements file, or specs like 'cowsay==6.1,humanize'",
    )
    @argument("--quiet", "-q", action="store_true", help="no per-epoch text lines under the panel")
    @argument(
        "--workers", type=int, default=1, help="train the fit on N workers together (data-parallel, Keras on JAX)"
    )
    @cell_magic
    def cloud_fit(self, line: str, cell: str) -> Any:
        """Run this cell with its one `.fit(...)` call on a remote machine.

        Statements before the call run here first; the call runs remotely; its assignment target receives a
        History; statements after it run here once the trained weights and optimizer state are back in the same
        model object. Ctrl-C detaches (the job goes on): `%cloud_attach JOB` picks it up again.

        The fit may also sit in a for/while loop, an if, a with or a try (or inside an expression): then the cell
        runs here as written and each time it reaches the fit, that fit is a job of its own whose History it gets,
        the trained state back in the model before the next statement; a looped fit keeps its machine warm for the
        next one (300 s unless --cool-down says otherwise), and a detach or cancel ends the cell there.
        """
        return run_sync(self._cloud_fit(line, cell))

    async def cloud_fit_async(self, line: str, cell: str) -> Any:
        """What a notebook cell runs: the same magic, waiting on the kernel's loop so widget clicks arrive."""
        return await run_async(self._cloud_fit(line, cell))

    async def _cloud_fit(self, line: str, cell: str) -> Any:
        args = _parse(self.cloud_fit, line)
        try:
            return await self._cloud_fit_steps(args, cell)
        except AibroError as exc:
            raise UsageError(str(exc)) from None

    async def _cloud_fit_steps(self, args: Any, cell: str) -> Any:
        ns = self.shell.user_ns
        helper = f"__aibro_fit_{secrets.token_hex(6)}"  # what a fit in a block calls: no name of the notebook's
        plan = fit_cell(self.shell.transform_cell(cell), helper)
        if isinstance(plan, FitInBlock):
            return await CellFits(self, args, plan, helper).run()
        split = plan
        _exec(split.before, ns, split.filename)
        model, model_src = self._receiver(split, ns)
        fit_args = _bind_fit(split.call, ns, split.filename)
        machines = args.machine
        cool_down = args.cool_down if args.cool_down is not None else (self.default_cool_down or 0)
        if machines is None and self.default_machines:
            machines = ",".join(self.default_machines)
        if machines is None:
            machines, cool_down = await self._pick(cool_down, self._quiet_predictions(model, fit_args))
        job = self._submit(args, model, model_src, fit_args, machines, cool_down)
        job_id = job.job_id
        if args.detach:
            print(f"{job_id} started on {', '.join(job.machines)}; follow it with %cloud_attach {job_id}")
            return None
        view = await self._follow(job_id, job.description, job.machines, quiet=args.quiet, workers=job.workers)
        if view is None:
            return None
        with self.last_panel.after_fit():  # what runs after the fit shows in the panel too (it survives a reload)
            trained, history = self.trainer.collect(view, model, not args.unsafe, args.ckpt_dir, args.log_dir)
            if args.into:
                ns[args.into] = trained
            if split.target is not None:
                ns["__aibro_history__"] = history
                _exec([ast.Assign(targets=[split.target], value=ast.Name("__aibro_history__", ast.Load()))], ns)
                ns.pop("__aibro_history__", None)
            return _exec_returning_last(split.after, ns, split.filename)

    def _submit(
        self, args: Any, model: Any, model_src: str, fit_args: dict[str, Any], machines: str, cool_down: float
    ) -> Job:
        """Create the job of one fit (the cell's options, the fit's bound arguments); returns the job."""
        x, y = fit_args.pop("x", None), fit_args.pop("y", None)
        request = FitRequest(
            model,
            x,
            y,
            machine_ids=machines,
            batch_size=fit_args.pop("batch_size", None),
            epochs=fit_args.pop("epochs", 1),
            validation_data=fit_args.pop("validation_data", None),
            description=args.description,
            cool_down_period_s=cool_down,
            fit_kwargs=fit_args,
            wait_request_s=args.wait_request,
            wait_new_job_create_s=args.wait_slot,
            record=not args.no_record,
            safe_mode=not args.unsafe,
            meta={"variable": args.into or model_src},
            requirements=args.requirements,
            workers=args.workers,
            argnames={
                "requirements": "--requirements",
                "workers": "--workers",
                "machine_ids": "--machine",
                "cool_down_period_s": "--cool-down",
                "wait_request_s": "--wait-request",
                "wait_new_job_create_s": "--wait-slot",
                "description": "--description",
                "train_X": "x",
                "train_Y": "y",
                "sample_weight": "sample_weight",
            },
        )
        return self.trainer.submit(request)

    @magic_arguments()
    @argument("--machine", "-m", default=None, help="ordered machine list each trial runs on, e.g. local-cpu")
    @argument("--parallel", "-p", type=int, default=1, help="trials running at once (each trial is a job)")
    @argument("--cool-down", type=float, default=None, help="seconds to keep a machine warm for the next trial")
    @argument("--wait-request", type=float, default=60, help="seconds to wait for a machine before the next one")
    @argument("--description", "-d", default="", help="a note shown in study and job lists")
    @argument("--detach", action="store_true", help="start the study and return at once; attach later")
    @argument("--into", default="best_model", help="variable that receives the best trial's trained model")
    @argument(
        "--requirements",
        "-r",
        default=None,
        help="packages the workers install: a requirements file, or specs like 'keras-tuner==1.4.8'",
    )
    @argument("--quiet", "-q", action="store_true", help="no line per trial")
    @cell_magic
    def cloud_tune(self, line: str, cell: str) -> Any:
        """Run this cell's one `tuner.search(...)` (a KerasTuner RandomSearch, BayesianOptimization, Hyperband or
        GridSearch built on `def build_model(hp)`) as a study: each trial is a job on --machine, up to --parallel
        at once, driven by the backend, so the study goes on if this kernel stops (`%cloud_attach STUDY --tuner
        NAME` follows it again). Afterwards the tuner answers get_best_hyperparameters(), get_best_models() and
        results_summary() as after a local search, and --into (best_model) holds the best trial's trained model.
        """
        return run_sync(self._cloud_tune(line, cell))

    async def cloud_tune_async(self, line: str, cell: str) -> Any:
        return await run_async(self._cloud_tune(line, cell))

    async def _cloud_tune(self, line: str, cell: str) -> Any:
        args = _parse(self.cloud_tune, line)
        try:
            return await self._cloud_tune_steps(args, cell)
        except AibroError as exc:
            raise UsageError(str(exc)) from None

    async def _cloud_tune_steps(self, args: Any, cell: str) -> Any:
        from .search import start_study

        ns = self.shell.user_ns
        split = split_cell(self.shell.transform_cell(cell), "search", "%%cloud_tune")
        _exec(split.before, ns, split.filename)
        if not isinstance(split.call.func, ast.Attribute):
            raise ValidationError("write the search as `tuner.search(x, y, epochs=...)`")
        tuner, tuner_src = _eval(split.call.func.value, ns, split.filename), ast.unparse(split.call.func.value)
        fit_args = _bind_fit(split.call, ns, split.filename)
        search_args = set(fit_args)  # what a HyperModel's own fit is given, as from tuner.search
        machines = args.machine or (",".join(self.default_machines) if self.default_machines else None)
        cool_down = args.cool_down if args.cool_down is not None else (self.default_cool_down or 0)
        if machines is None:
            machines, cool_down = await self._pick(cool_down)
        request = FitRequest(
            None,  # each trial's model is the tuner's
            fit_args.pop("x", None),
            fit_args.pop("y", None),
            machine_ids=machines,
            batch_size=fit_args.pop("batch_size", None),
            epochs=fit_args.pop("epochs", 1),
            validation_data=fit_args.pop("validation_data", None),
            description=args.description,
            cool_down_period_s=cool_down,
            fit_kwargs=fit_args,
            wait_request_s=args.wait_request,
            requirements=args.requirements,
        )
        study_id = start_study(
            self.trainer, tuner, request, parallel=args.parallel, verbose=not args.quiet, search_args=search_args
        )
        again = f"%cloud_attach {study_id} --tuner {tuner_src} --into {args.into}"
        if args.detach:
            print(f"{study_id} started; follow it with {again}")
            return None
        study = await self._follow_study(study_id, args.description, again, not args.quiet)
        if study is None:
            return None
        self._bind_study(tuner, study, args.into, tuner_src)
        if split.target is not None:
            ns["__aibro_search__"] = None  # what tuner.search returns
            _exec([ast.Assign(targets=[split.target], value=ast.Name("__aibro_search__", ast.Load()))], ns)
            ns.pop("__aibro_search__", None)
        return _exec_returning_last(split.after, ns, split.filename)

    def _receiver(self, split: SplitCell, ns: dict[str, Any]) -> tuple[Any, str]:
        func = split.call.func
        assert isinstance(func, ast.Attribute)
        src = ast.unparse(func.value)
        return keras_model(_eval(func.value, ns, split.filename), src), src

    def _quiet_predictions(self, model: Any, fit_args: dict[str, Any]) -> list[Prediction] | None:
        """The fit's predicted time and cost on each machine, for the picker; None (its columns left out) when they
        cannot be had: the fit's own checks name any problem of its arguments when it starts."""
        try:
            return self.trainer.predictions(_predicted_fit(model, fit_args), verbose=False)
        except (AibroError, ValueError, TypeError):
            return None

    async def _pick(self, cool_down: float, predictions: list[Prediction] | None = None) -> tuple[str, float]:
        from .widgets.picker import MachinePicker

        picker = MachinePicker(self.trainer.client.machines(), cool_down, predictions)
        display(picker)  # it says what to do, and folds into one line at Start
        await until(picker.started.is_set)
        assert picker.chosen is not None
        machines, cool = picker.chosen
        return ",".join(machines), cool

    async def _follow(
        self,
        job_id: str,
        description: str,
        machines: list[str],
        quiet: bool = False,
        show: Callable[[Any], Any] = display,
        notes: set[str] | None = None,
        workers: int = 1,
    ) -> JobView | None:
        """Show the panel (`show`: displayed in the cell, or in the place of a fit's panel before it) and follow the
        job until it ends; None when the user detached. A worker's note already in `notes` is not printed again (the
        same warning from every job of a loop)."""
        from .widgets.progress_panel import ProgressPanel

        panel = ProgressPanel(job_id, description, machines, workers)
        panel.on_cancel(lambda: self.trainer.client.cancel(job_id))
        self.last_panel = panel
        show(panel)
        text = TextProgress()
        stop = threading.Event()

        asked = [0.0]  # when the cost was last fetched
        prices: dict[str, float] = {}  # machine id -> its hourly price, read once from the marketplace

        def watch() -> JobView | None:
            def watcher(view: JobView, ev: dict[str, Any]) -> None:
                if stop.is_set():
                    raise _Stop
                now = time.monotonic()
                if ev["type"] == v.EV_STATUS or (ev["type"] == v.EV_EPOCH and now - asked[0] >= COST_EVERY_S):
                    asked[0] = now  # at most one job fetch per 10 s of epochs: a replay of 200 epochs asks once
                    self._charge(view, prices)
                panel.update(view, ev)
                note = worker_note(ev)
                if note and notes is not None:
                    if note in notes:
                        return
                    notes.add(note)
                shown = ev["type"] in (v.EV_EPOCH, v.EV_ERROR) or note
                if local_notice(ev) or printed(ev) is not None or (not quiet and shown):
                    text(view, ev)  # a notice ("backend unreachable, restarting…") shows even with --quiet

            try:
                return self.trainer.watch(job_id, [watcher])
            except _Stop:
                return None

        detached = f"Detached; {job_id} keeps training. Attach again with: %cloud_attach {job_id}"
        return await _on_a_thread(panel, job_id, watch, stop, detached)

    async def _follow_study(self, study_id: str, description: str, again: str, verbose: bool = True) -> Study | None:
        """Show the study's panel and follow the study until it ends; None when the user detached."""
        from .search import follow
        from .widgets.study_panel import StudyPanel

        client = self.trainer.client
        panel = StudyPanel(study_id, description, again)
        panel.on_cancel(lambda: client.cancel_study(study_id))
        self.last_panel = panel
        display(panel)
        stop = threading.Event()
        detached = f"Detached; {study_id} goes on. Follow it again with {again}"
        return await _on_a_thread(
            panel, study_id, lambda: follow(client, study_id, verbose, on_poll=panel.update, stop=stop), stop, detached
        )

    def _bind_study(self, tuner: Any, study: Study, into: str, tuner_src: str | None) -> None:
        """The study's trials into the tuner and the best trial's model into `into`; the panel says which, and
        which trials failed; a study that failed then fails the cell, as KerasTuner's search raises."""
        from .search import check_ended, failures, finish
        from .widgets.study_panel import StudyPanel

        panel = self.last_panel
        try:
            self.shell.user_ns[into] = model = finish(self.trainer, tuner, study)
        except Exception as exc:
            if isinstance(panel, StudyPanel):
                panel.cell_done("", f"the results could not come back: {exc}")
            raise
        if isinstance(panel, StudyPanel):
            told = f"; {tuner_src} holds every trial" if tuner_src else ""
            best = study.best_trial_id
            bound = (
                f"{into} holds trial {best}'s trained model{told}"
                if model is not None
                else f"no trial completed: {into} is None{told}"
            )
            failed = failures(study)
            ended = f"study failed: {study.message or ''}" if study.status == v.STUDY_FAILED else ""
            panel.cell_done(bound + (f". {failed}" if failed else ""), ended + (f". {bound}" if ended else ""))
        check_ended(study)

    # -- line magics --------------------------------------------------------------------------------
    @magic_arguments()
    @argument("--use", default=None, help="make this machine list the session default for %%cloud_fit")
    @argument("--cool-down", type=float, default=None, help="session default cool-down in seconds")
    @argument(
        "--predict",
        metavar="FIT",
        default=None,
        help="last on the line: a fit call, e.g. model.fit(x, y, epochs=20, batch_size=64): its predicted time and "
        "cost on each machine (on --use's machines if given)",
    )
    @line_magic
    def cloud_machines(self, line: str) -> None:
        """List the machines you can train on; `--use LIST` sets the session default; `--predict FIT` says what
        that fit would take on each of them."""
        line, _, fit = line.partition("--predict")
        args = _parse(self.cloud_machines, line)
        if _ and not fit.strip():
            raise UsageError("--predict needs a fit call after it, e.g. %cloud_machines --predict model.fit(x, y)")
        offers = self.trainer.client.machines()
        if args.use:
            known = {o.machine_id for o in offers}
            chosen = [m.strip() for m in args.use.split(",") if m.strip()]
            unknown = [m for m in chosen if m not in known]
            if unknown:
                raise UsageError(f"unknown machine {unknown[0]!r}; available: {sorted(known)}")
            self.default_machines = chosen
            print(f"%%cloud_fit now defaults to {', '.join(chosen)}")
        if args.cool_down is not None:
            self.default_cool_down = args.cool_down
        if fit.strip():
            self._predict(fit.strip(), args.use)
            return
        print(format_machines(offers))

    def _predict(self, fit: str, machines: str | None) -> None:
        """`%cloud_machines --predict model.fit(...)`: the fit's arguments evaluated here, as %%cloud_fit would."""
        try:
            call = ast.parse(fit, "<cloud_machines>", mode="eval").body
        except SyntaxError as exc:
            raise UsageError(f"--predict takes a fit call, e.g. model.fit(x, y, epochs=5): {exc.msg}") from None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "fit"):
            raise UsageError(f"--predict takes a fit call, e.g. model.fit(x, y, epochs=5), not {fit!r}")
        ns = self.shell.user_ns
        src = ast.unparse(call.func.value)
        model = keras_model(_eval(call.func.value, ns, "<cloud_machines>"), src)
        request = _predicted_fit(model, _bind_fit(call, ns, "<cloud_machines>"), machines)
        try:
            self.trainer.predictions(request)
        except AibroError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def cloud_jobs(self, line: str) -> None:
        """List your jobs: status, substatus, epochs done, machine, description."""
        print(JOBS_HEAD)
        for j in self.trainer.client.jobs():
            print(job_row(j))

    @magic_arguments()
    @argument("job_id", help="a job id, or a study id (study-...)")
    @argument("--into", default=None, help="variable that receives the trained model (a study's best)")
    @argument("--tuner", default=None, help="for a study: the tuner variable that receives its results")
    @line_magic
    def cloud_attach(self, line: str) -> None:
        """Rebuild a job's panel from its full event history, follow it live, and load the model when it ends. For
        a study (`%cloud_attach STUDY --tuner tuner`): every trial so far, then the rest as they end, the results
        into the tuner and the best trial's model into --into (best_model)."""
        run_sync(self._cloud_attach(line))

    async def cloud_attach_async(self, line: str) -> None:
        """What a notebook cell runs: the same magic, waiting on the kernel's loop so widget clicks arrive."""
        await run_async(self._cloud_attach(line))

    async def _cloud_attach(self, line: str) -> None:
        args = _parse(self.cloud_attach, line)
        if args.job_id.startswith("study-"):
            try:
                tuner = self.shell.user_ns[args.tuner] if args.tuner else None
                into = args.into or "best_model"
                again = f"%cloud_attach {args.job_id}" + (f" --tuner {args.tuner}" if args.tuner else "")
                description = self.trainer.client.study(args.job_id).description
                study = await self._follow_study(args.job_id, description, again)
                if study is not None:
                    self._bind_study(tuner, study, into, args.tuner)
            except KeyError:
                raise UsageError(f"no variable {args.tuner!r} here: make the tuner first, as in its cell") from None
            except AibroError as exc:
                raise UsageError(str(exc)) from None
            return
        try:
            job = self.trainer.client.job(args.job_id)
            view = await self._follow(args.job_id, job.description, job.machines, workers=job.workers)
            if view is not None:
                with self.last_panel.after_fit():
                    self._bind(view, args.into or job.meta.get("variable"))
        except AibroError as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("job_id")
    @argument("--into", default=None, help="variable that receives the trained model")
    @line_magic
    def cloud_result(self, line: str) -> None:
        """Fetch a finished job's trained model into a variable (and `NAME_history`)."""
        args = _parse(self.cloud_result, line)
        try:
            view = JobView(args.job_id)
            for ev in self.trainer.client.events(args.job_id)["events"]:
                view.apply(ev)
            if not view.final:
                raise UsageError(f"{args.job_id} is still {view.status}; `%cloud_attach {args.job_id}` follows it")
            job = self.trainer.client.job(args.job_id)
            self._bind(view, args.into or job.meta.get("variable"))
        except AibroError as exc:
            raise UsageError(str(exc)) from None

    def _bind(self, view: JobView, name: str | None) -> None:
        name = name or "model"
        ns = self.shell.user_ns
        import keras

        existing = ns.get(name)
        target = existing if isinstance(existing, keras.Model) else None
        model, history = self.trainer.collect(view, target)
        ns[name] = model
        ns[f"{name}_history"] = history
        how = "in place" if target is not None else "as a new model"
        print(f"{view.job_id}: trained model loaded into `{name}` ({how}); history in `{name}_history`")

    @line_magic
    def cloud_cancel(self, line: str) -> None:
        """Cancel a job; the worker stops within about one batch."""
        job_id = line.strip()
        if not job_id:
            raise UsageError("usage: %cloud_cancel JOB_ID (see %cloud_jobs)")
        try:
            job = self.trainer.client.cancel(job_id)
        except AibroError as exc:
            raise UsageError(str(exc)) from None
        print(f"{job_id}: cancel requested ({job.status} · {job.substatus})")

    def _charge(self, view: JobView, prices: dict[str, float]) -> None:
        """The job's cost so far (the backend bills it from its instances' times) and the hourly price of the machine
        it runs on (or the first it asked for), as the sidebar reads them; both stay as they were if unreachable."""
        client = self.trainer.client
        try:
            job = client.job(view.job_id)
            if not prices:
                prices.update({m.machine_id: m.price_per_hour for m in client.machines()})
        except (AibroError, ValueError):  # unreachable, or an answer this client does not read
            return
        view.cost = float(job.cost)
        view.price_per_hour = prices.get(job.machine_id or (job.machines[0] if job.machines else ""))

    @magic_arguments()
    @argument("job_id", nargs="?", default=None, help="one job (with its chart); without it, every job of yours")
    @argument("--chart", choices=["pie", "funnel"], default="pie")
    @line_magic
    def cloud_timeline(self, line: str) -> Any:
        """Per job: seconds in each substatus (gear-up: requesting, connecting, gearing up, sending), training
        time and cost; for one job also a pie or funnel of its time."""
        args = _parse(self.cloud_timeline, line)
        try:
            jobs = [self.trainer.client.job(args.job_id)] if args.job_id else self.trainer.client.jobs()
        except AibroError as exc:
            raise UsageError(str(exc)) from None
        print(format_timelines(jobs))
        if not args.job_id:
            return None
        from .widgets.timeline import timeline_chart

        return timeline_chart(jobs[0].timeline, args.chart)


COST_EVERY_S = 10.0


def _parse(magic: Any, line: str) -> Any:
    """parse_argstring, with the quotes around a quoted value taken off (IPython keeps them)."""
    args = parse_argstring(magic, line)
    for key, val in vars(args).items():
        if isinstance(val, str) and len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            setattr(args, key, val[1:-1])
    return args


async def _on_a_thread(panel: Any, name: str, work: Callable[[], Any], stop: threading.Event, detached: str) -> Any:
    """Run `work` (following a job or a study to its end) on a thread while the cell waits on the kernel's loop, so
    the panel's buttons keep working; what it returned, or None once the user detached (Detach or Ctrl-C), which
    sets `stop` for the thread and says how to follow again."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except Exception as exc:  # noqa: BLE001 - raised in the cell's own thread below
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"aibro-{name}", daemon=True)
    thread.start()
    try:
        await until(lambda: not thread.is_alive() or panel.detached.is_set())
    except KeyboardInterrupt:
        panel.detach()
    if panel.detached.is_set():
        stop.set()
        print(detached, flush=True)
        return None
    if "error" in result:
        raise result["error"]
    return result.get("value")


class _Stop(Exception):
    """Ends the watcher thread after a detach."""


def _exec(stmts: list[ast.stmt], ns: dict[str, Any], filename: str = "<cloud_fit>") -> None:
    if stmts:
        module = ast.fix_missing_locations(ast.Module(body=stmts, type_ignores=[]))
        exec(compile(module, filename, "exec"), ns)  # noqa: S102 - the user's own cell, in their kernel


def _eval(node: ast.expr, ns: dict[str, Any], filename: str = "<cloud_fit>") -> Any:
    expr = ast.fix_missing_locations(ast.Expression(body=node))
    return eval(compile(expr, filename, "eval"), ns)  # noqa: S307 - the user's own cell


def _exec_returning_last(stmts: list[ast.stmt], ns: dict[str, Any], filename: str = "<cloud_fit>") -> Any:
    """Run the statements after the fit; like a cell, the value of a final expression is returned."""
    if stmts and isinstance(stmts[-1], ast.Expr):
        _exec(stmts[:-1], ns, filename)
        return _eval(stmts[-1].value, ns, filename)
    _exec(stmts, ns, filename)
    return None


def _predicted_fit(model: Any, fit_args: dict[str, Any], machines: str | None = None) -> FitRequest:
    """The fit a prediction is for: the model, the fit call's bound arguments, the machines to predict on."""
    args = dict(fit_args)
    x, y, batch_size = args.pop("x", None), args.pop("y", None), args.pop("batch_size", None)
    return FitRequest(model, x, y, machines, batch_size, args.pop("epochs", 1), fit_kwargs=args)


def keras_model(value: Any, src: str) -> Any:
    """`value`, the receiver of the cell's `src.fit(...)`, when it is a Keras model; else the refusal."""
    import keras

    if not isinstance(value, keras.Model):
        raise ValidationError(
            f"`{src}.fit(...)`: `{src}` is a {type(value).__module__}.{type(value).__name__}, not a Keras model; "
            "%%cloud_fit runs keras.Model.fit remotely"
        )
    return value


def _bind_fit(call: ast.Call, ns: dict[str, Any], filename: str = "<cloud_fit>") -> dict[str, Any]:
    """The fit call's arguments, evaluated here and bound to keras.Model.fit's signature."""
    args = []
    for a in call.args:
        if isinstance(a, ast.Starred):
            args.extend(_eval(a.value, ns, filename))
        else:
            args.append(_eval(a, ns, filename))
    kwargs: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None:
            kwargs.update(_eval(kw.value, ns, filename))
        else:
            kwargs[kw.arg] = _eval(kw.value, ns, filename)
    return bind_fit(args, kwargs)


def bind_fit(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A fit call's argument values bound to keras.Model.fit's signature, by name."""
    import keras

    sig = inspect.signature(keras.Model.fit)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise ValidationError(f"the .fit(...) call does not match keras.Model.fit: {exc}") from None
    out = dict(bound.arguments)
    out.pop("self", None)
    out.update(out.pop("kwargs", {}) or {})
    return out


def load_ipython_extension(ipython: Any) -> None:
    from .quiet import import_tensorflow_quietly

    import_tensorflow_quietly()  # before the notebook's `import keras`: no native start-up lines in its output
    ipython.register_magics(CloudMagics)
    cleanup = ipython.input_transformers_cleanup
    if awaitable_magics not in cleanup:
        cleanup.append(awaitable_magics)
