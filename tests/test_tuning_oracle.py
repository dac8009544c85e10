"""A study's search state lives with the backend (issue 27 items 2 and 3): KerasTuner's own oracles, in a host
process the backend speaks JSON lines to, run a 6-trial RandomSearch over two slots as KerasTuner's distributed
tuners would, and a host killed mid-study comes back with every trial so far; told which trials still run as jobs,
it never hands them out again, and every trial ends exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import keras
import keras_tuner as kt  # noqa: F401  (the test extra has it: missing fails, never skips)
import numpy as np
import pytest

from aibro_backend.storage.store import Store
from aibro_backend.tuning.oracle_client import OracleHost
from aibro_backend.tuning.oracle_host import OracleRequest
from aibro_backend.tuning.studies import StudyDriver
from aibro_core.models import OracleSpec


def _space() -> dict:
    """What a kernel's `build_model(hp)` registers: KerasTuner's HyperParameters, as its config."""
    hp = kt.HyperParameters()
    hp.Int("units", 8, 128, step=8)
    hp.Choice("learning_rate", [1e-2, 1e-3, 1e-4])
    hp.Boolean("dropout")
    return hp.get_config()


def _loss(values: dict) -> float:
    """A stand-in objective with one best corner: many units, lr 1e-3."""
    return 1.0 / values["units"] + abs(values["learning_rate"] - 1e-3) * 10


async def _create(host: OracleHost, slot: str) -> dict:
    got = await host.ask(OracleRequest(op="create_trial", slot=slot))
    assert got.ok, got.error
    return got.trial.model_dump() | {"stopped": got.stopped}


async def _end(host: OracleHost, trial: dict) -> None:
    got = await host.ask(
        OracleRequest(
            op="end_trial", trial_id=trial["trial_id"], status="COMPLETED", metrics={"val_loss": _loss(trial["values"])}
        )
    )
    assert got.ok and got.trial.status == "COMPLETED", got


def test_a_random_search_over_two_slots_survives_its_host_being_killed(tmp_path: Path) -> None:
    spec = OracleSpec(
        kind="RandomSearch",
        objective=[{"name": "val_loss", "direction": "min"}],
        hyperparameters=_space(),
        max_trials=6,
        seed=3,
    )

    async def study() -> None:
        running: dict[str, dict] = {}
        host = OracleHost.create(
            tmp_path / "study", spec, lambda: {r["trial_id"]: slot for slot, r in running.items() if not r["stopped"]}
        )
        ended: list[str] = []
        for slot in ("slot-0", "slot-1"):
            running[slot] = await _create(host, slot)
        assert running["slot-0"]["trial_id"] != running["slot-1"]["trial_id"]
        assert running["slot-0"]["values"] != running["slot-1"]["values"], "each slot runs other values"
        for slot in ("slot-0", "slot-1"):
            await _end(host, running[slot])
            ended.append(running[slot]["trial_id"])
            running[slot] = await _create(host, slot)
        await _end(host, running["slot-0"])
        ended.append(running["slot-0"]["trial_id"])
        running["slot-0"] = await _create(host, "slot-0")
        interrupted = {r["trial_id"]: r["values"] for r in running.values()}
        assert len(interrupted) == 2

        os.kill(host.proc.pid, signal.SIGKILL)  # mid-study: 3 trials ended, two running (their jobs go on)
        await host.proc.wait()
        seen = await host.ask(OracleRequest(op="trials"))  # the host starts again, told what still runs
        assert [t.trial_id for t in seen.trials if t.status == "COMPLETED"] == sorted(ended)
        assert {t.trial_id for t in seen.trials if t.status == "RUNNING"} == set(interrupted)
        for slot in ("slot-0", "slot-1"):
            again = await _create(host, slot)
            assert again["trial_id"] == running[slot]["trial_id"], "a running trial is not handed out again"
        twice = await host.ask(
            OracleRequest(op="end_trial", trial_id=ended[0], status="COMPLETED", metrics={"val_loss": 0.0})
        )
        assert not twice.ok and "COMPLETED already" in twice.error, "a trial ends once"
        while not all(r["stopped"] for r in running.values()):
            for slot in ("slot-0", "slot-1"):
                if not running[slot]["stopped"]:
                    await _end(host, running[slot])
                    ended.append(running[slot]["trial_id"])
                    running[slot] = await _create(host, slot)
        final = await host.ask(OracleRequest(op="trials"))
        await host.close()
        assert sorted(ended) == sorted(set(ended)) and len(ended) == 6, f"every trial ended exactly once: {ended}"
        assert [t.status for t in final.trials] == ["COMPLETED"] * 6
        scores = {t.trial_id: t.score for t in final.trials}
        assert final.best == sorted(scores, key=lambda t: scores[t]), "best first, by the objective"
        assert len({str(t.values) for t in final.trials}) == 6, "no values tried twice"

    asyncio.run(study())


def test_an_oracle_spec_names_what_its_kind_does_not_take() -> None:
    with pytest.raises(ValueError, match="a Hyperband oracle takes no max_trials"):
        OracleSpec(
            kind="Hyperband",
            objective=[{"name": "val_loss", "direction": "min"}],
            hyperparameters=_space(),
            max_trials=3,
        )


@pytest.mark.parametrize(
    "space",
    [
        {"space": [{"class_name": "Lambda", "config": {"name": "x"}}], "values": {}},
        {"space": [{"class_name": "Int", "config": {"name": "u"}, "module": "os"}], "values": {}},
        {"space": [{"class_name": "Int", "config": {"name": "u", "conditions": [{"class_name": "Eval"}]}}]},
        {"space": {"class_name": "Int"}},
        {"space": [], "values": {}, "extra": 1},
    ],
)
def test_a_space_is_kerastuners_config_and_nothing_else(space: dict) -> None:
    """The oracle host deserializes the space with KerasTuner: only its own kinds get there."""
    with pytest.raises(ValueError, match="oracle.hyperparameters"):
        OracleSpec(kind="RandomSearch", objective=[{"name": "val_loss", "direction": "min"}], hyperparameters=space)
    OracleSpec(kind="RandomSearch", objective=[{"name": "val_loss", "direction": "min"}], hyperparameters=_space())


@pytest.mark.fast
def test_a_step_the_loop_had_queued_does_not_run_once_the_driver_closed(tmp_path: Path) -> None:
    """On SIGTERM the backend closes the driver, then the store. A step the timer had already queued used to run in
    between and fail on the closed database (a full run's backend log caught it once); now it does nothing."""

    async def shut_down_with_a_step_queued() -> None:
        store = Store(tmp_path / "s.db")
        driver = StudyDriver(SimpleNamespace(store=store))
        queued = asyncio.ensure_future(driver.step())
        await driver.close()
        store.close()
        await queued

    asyncio.run(shut_down_with_a_step_queued())


def _history(seed: int, epochs: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    return {
        name: [float(v) for v in rng.random(epochs)] for name in ("loss", "val_loss", "val_accuracy", "learning_rate")
    }


@pytest.mark.fast
@pytest.mark.parametrize(
    "objective",
    [
        [("val_loss", "min")],
        [("val_accuracy", "max")],
        [("val_loss", "min"), ("val_accuracy", "max")],  # KerasTuner's MultiObjective: their sum, minimized
    ],
)
def test_a_trials_executions_are_scored_as_kerastuner_scores_them(objective: list[tuple[str, str]]) -> None:
    """The study scores each execution's History and averages them with KerasTuner's own rules (issue 35): the
    metrics at the first best epoch, each metric's mean over the executions, the mean best epoch; the checkpoint is
    the best epoch of all the executions. KerasTuner's tuner_utils is the reference."""
    from keras_tuner.src.engine import objective as objective_module
    from keras_tuner.src.engine import tuner_utils

    from aibro_backend.storage.records import ExecutionRecord
    from aibro_backend.tuning.studies import average_metrics, best_epoch_metrics, mean_step, trial_checkpoint
    from aibro_core.models import Objective

    ours = [Objective(name=name, direction=way) for name, way in objective]
    theirs = objective_module.create_objective([kt.Objective(n, d) for n, d in objective])
    if len(objective) == 1:
        theirs = kt.Objective(*objective[0])
    histories = [_history(seed, 4) for seed in range(3)]
    runs = []
    for i, history in enumerate(histories):
        metrics, step, why = best_epoch_metrics(history, ours)
        assert why is None
        kept = keras.callbacks.History()
        kept.history = history
        expected, expected_step = tuner_utils._get_best_value_and_best_epoch_from_history(kept, theirs)
        assert (metrics, step) == (pytest.approx(expected), expected_step)
        runs.append(ExecutionRecord(f"job-{i}", "s", "0", i, "COMPLETED", metrics, step, step, 0.0))
    kept_all = []
    for history in histories:
        kept = keras.callbacks.History()
        kept.history = history
        kept_all.append(kept)
    assert average_metrics([r.metrics for r in runs]) == pytest.approx(
        {k: float(val) for k, val in tuner_utils.convert_to_metrics_dict(kept_all, theirs).items()}
    )
    assert mean_step(runs) == tuner_utils.get_best_step(kept_all, theirs)
    values = [theirs.get_value(r.metrics) for r in runs]
    pick = min if theirs.direction == "min" else max
    best = pick(range(3), key=values.__getitem__)
    assert trial_checkpoint(runs, ours) == (f"job-{best}", runs[best].best_epoch)


@pytest.mark.fast
def test_an_ended_trial_takes_what_its_fit_registered_and_an_error_is_retried_as_kerastuner_retries(
    tmp_path: Path,
) -> None:
    """end_trial with the trial's hyperparameters as its fit left them puts a hyperparameter first registered there
    into the space (KerasTuner's end_trial does); an INVALID trial comes back for max_retries_per_trial more runs,
    then is FAILED (issue 35)."""
    spec = OracleSpec(
        kind="RandomSearch",
        objective=[{"name": "val_loss", "direction": "min"}],
        hyperparameters=_space(),
        max_trials=3,
        seed=1,
        max_retries_per_trial=1,
    )

    async def study() -> None:
        host = OracleHost.create(tmp_path / "study", spec)
        try:
            first = await _create(host, "slot-0")
            hp = kt.HyperParameters.from_config(_space())
            hp.values = dict(first["values"])
            hp.Choice("batch_size", [16, 64])  # what a HyperModel.fit registers during the trial
            got = await host.ask(
                OracleRequest(
                    op="end_trial",
                    trial_id=first["trial_id"],
                    status="COMPLETED",
                    metrics={"val_loss": 0.5},
                    hyperparameters=hp.get_config(),
                )
            )
            assert got.ok and got.trial.values["batch_size"] == 16, got
            second = await _create(host, "slot-0")
            assert "batch_size" in second["values"], "the space holds it now: the oracle samples it"
            for run in (1, 2):
                ended = await host.ask(
                    OracleRequest(op="end_trial", trial_id=second["trial_id"], status="INVALID", message="boom")
                )
                assert ended.trial.status == ("INVALID" if run == 1 else "FAILED"), ended
                if run == 1:
                    again = await _create(host, "slot-0")
                    assert again["trial_id"] == second["trial_id"], "retried once, as max_retries_per_trial=1 says"
        finally:
            await host.close()

    asyncio.run(study())
