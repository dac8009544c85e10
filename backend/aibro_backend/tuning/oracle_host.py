"""KerasTuner's oracle, used as it is, in a process of its own beside the backend (issue 27).

A study's search state is the oracle's: which values each trial runs, which trials are done, the best so far. It
lives in `<study dir>/oracle/` as KerasTuner writes it (`oracle.json`, `trial_*/trial.json`), so a restarted host
reloads it and a study outlives the kernel, the browser and the backend. The backend never imports Keras: it
starts this host (`python -m aibro_backend.tuning.oracle_host STUDY_DIR`) and speaks JSON lines to it on stdin and
stdout, one answer per request (`OracleRequest` → `OracleAnswer`). A trial's slot is KerasTuner's `tuner_id`, one
per trial allowed to run at once, as its own distributed tuners use them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from aibro_core.compat import keras_tuner as kt_compat
from aibro_core.models import BoundedJson, OracleSpec, hyperparameters_config
from aibro_core.vocabulary import TunerTrialStatus

MAX_LINE = 1 << 20
SLOT_PATTERN = r"^slot-[0-9]{1,3}$"
TRIAL_PATTERN = r"^[0-9]{1,6}$"
MetricValue = Annotated[float, Field(allow_inf_nan=True)]
TrialId = Annotated[str, Field(pattern=TRIAL_PATTERN)]
Slot = Annotated[str, Field(pattern=SLOT_PATTERN)]


class OracleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: Literal["resume", "create_trial", "end_trial", "trials"]
    slot: Slot | None = None
    trial_id: TrialId | None = None
    status: Literal[TunerTrialStatus.COMPLETED, TunerTrialStatus.INVALID, TunerTrialStatus.FAILED] | None = None
    metrics: Annotated[dict[str, MetricValue], Field(max_length=200)] = {}
    message: Annotated[str, Field(max_length=4000)] | None = None
    running: Annotated[dict[TrialId, Slot], Field(max_length=64)] = {}
    step: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    hyperparameters: (
        Annotated[BoundedJson, AfterValidator(lambda value: hyperparameters_config(value, "hyperparameters"))] | None
    ) = None  # end_trial: the trial's HyperParameters as its run left them (a HyperModel.fit may register more)


class TrialState(BaseModel):
    trial_id: str
    status: str
    values: dict[str, Any]
    score: float | None = None
    best_step: int | None = None
    message: str | None = None
    hyperparameters: dict[str, Any] | None = None  # its HyperParameters config: its space and values


class OracleAnswer(BaseModel):
    ok: bool = True
    error: str | None = None
    trial: TrialState | None = None
    trials: list[TrialState] = []
    best: list[str] = []
    stopped: bool = False


def make_oracle(spec: OracleSpec, directory: Path) -> Any:
    """The oracle of `spec`'s kind, its project at `directory/oracle`, reloaded when it was saved before."""
    import keras_tuner as kt

    kinds = {
        "RandomSearch": kt.oracles.RandomSearchOracle,
        "BayesianOptimization": kt.oracles.BayesianOptimizationOracle,
        "Hyperband": kt.oracles.HyperbandOracle,
        "GridSearch": kt.oracles.GridSearchOracle,
    }
    extra = spec.model_dump(exclude={"kind", "objective", "hyperparameters"}, exclude_none=True)
    objective = [kt.Objective(o.name, o.direction) for o in spec.objective]
    oracle = kinds[spec.kind](
        objective=objective[0] if len(objective) == 1 else objective,
        hyperparameters=kt.HyperParameters.from_config(spec.hyperparameters),
        **extra,
    )
    kt_compat.set_project_dir(oracle, str(directory), "oracle")
    if (directory / "oracle" / "oracle.json").exists():
        oracle.reload()  # trials ongoing when the host stopped go back in the queue, as KerasTuner resumes
    oracle.verbose = 0
    return oracle


def trial_state(trial: Any) -> TrialState:
    return TrialState(
        trial_id=trial.trial_id,
        status=str(trial.status),
        values=dict(trial.hyperparameters.values),
        score=None if trial.score is None else float(trial.score),
        best_step=None if trial.best_step is None else int(trial.best_step),
        message=trial.message,
        hyperparameters=trial.hyperparameters.get_config(),
    )


def answer(oracle: Any, req: OracleRequest) -> OracleAnswer:
    """One request against the oracle, as KerasTuner's own tuners call it. `resume` (sent first after a start)
    says which trials still run as jobs, and in which slot: KerasTuner's reload put them back in the queue, and
    they must not be handed out a second time. One the oracle had already ended (the host was killed after saving
    its end, before the backend heard the answer) stays ended: the backend's end_trial, sent again, hears so."""
    if req.op == "resume":
        unknown = sorted(set(req.running) - set(oracle.trials))
        if unknown:
            return OracleAnswer(ok=False, error=f"resume names trials the oracle never made: {unknown}")
        for trial_id, slot in req.running.items():
            kt_compat.forget_pending_retry(oracle, trial_id)
            trial = oracle.trials[trial_id]
            if str(trial.status) in (TunerTrialStatus.COMPLETED, TunerTrialStatus.FAILED):
                continue
            trial.status = TunerTrialStatus.RUNNING.value
            oracle.ongoing_trials[slot] = trial
        oracle.save()
        return OracleAnswer()
    if req.op == "create_trial":
        if req.slot is None:
            return OracleAnswer(ok=False, error="create_trial needs 'slot'")
        trial = oracle.create_trial(req.slot)
        return OracleAnswer(trial=trial_state(trial), stopped=str(trial.status) == TunerTrialStatus.STOPPED)
    if req.op == "end_trial":
        if req.trial_id is None or req.status is None or req.trial_id not in oracle.trials:
            return OracleAnswer(ok=False, error=f"end_trial needs a known 'trial_id' and a 'status': {req}")
        trial = oracle.trials[req.trial_id]
        # a trial ends once: a second report (a retried request) changes nothing
        if str(trial.status) != TunerTrialStatus.RUNNING:
            return OracleAnswer(
                ok=False, error=f"trial {trial.trial_id} is {trial.status} already", trial=trial_state(trial)
            )
        if req.hyperparameters is not None:  # as KerasTuner's end_trial takes the tuner's copy of the trial's
            import keras_tuner as kt

            reported = kt.HyperParameters.from_config(req.hyperparameters)
            given = trial.hyperparameters.values
            if all(k in reported.values and reported.values[k] == val for k, val in given.items()):
                trial.hyperparameters = reported  # end_trial's update_space then adds what the fit registered
        if req.metrics:
            oracle.update_trial(trial.trial_id, req.metrics, step=req.step)
        trial.status, trial.message = str(req.status), req.message  # KerasTuner's plain string
        try:
            oracle.end_trial(trial)
        except RuntimeError as exc:  # too many failures in a row: the study stops, as KerasTuner's search does
            return OracleAnswer(ok=False, error=str(exc), trial=trial_state(oracle.trials[req.trial_id]))
        return OracleAnswer(trial=trial_state(oracle.trials[req.trial_id]))
    trials = [trial_state(oracle.trials[t]) for t in sorted(oracle.trials)]
    return OracleAnswer(trials=trials, best=[t.trial_id for t in oracle.get_best_trials(len(oracle.trials))])


def serve(directory: Path, out: Any) -> int:
    """Answer requests on stdin, on `out`, until stdin closes. The oracle's files are written whole or not at all:
    a host killed while it saves leaves the last state it saved, which the next start reloads."""
    kt_compat.atomic_json_saves()
    spec = OracleSpec.model_validate_json((directory / "oracle-spec.json").read_text())
    oracle = make_oracle(spec, directory)
    print(OracleAnswer().model_dump_json(), file=out, flush=True)  # ready
    for line in sys.stdin:
        if len(line) > MAX_LINE:
            reply = OracleAnswer(ok=False, error="request over 1 MiB")
        else:
            try:
                reply = answer(oracle, OracleRequest.model_validate_json(line))
            except ValueError as exc:
                reply = OracleAnswer(ok=False, error=f"bad request: {exc}")
        print(reply.model_dump_json(), file=out, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m aibro_backend.tuning.oracle_host STUDY_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the oracle computes nothing on a GPU
    out = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # whatever Keras or TensorFlow prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    try:
        import keras_tuner  # noqa: F401
    except ImportError:
        error = "keras-tuner is not installed where the backend runs: pip install 'aibro-jupyter[tune]'"
        print(OracleAnswer(ok=False, error=error).model_dump_json(), file=out, flush=True)
        return 3
    return serve(Path(args[0]), out)


if __name__ == "__main__":
    sys.exit(main())
