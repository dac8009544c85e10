"""The study panel's pieces (issue 27 item 4) on a study as GET /studies/{id} answers it: the trials table sorts by
any column with the trials that have no value last, the best-so-far curve only improves, the loss chart draws each
trial that trained (the running ones in colour), the parallel coordinates draw one line per scored trial across
one axis per hyperparameter and the objective, and a final study leaves no Cancel or Detach to click."""

from __future__ import annotations

import pytest

from aibro_core.models import Study
from aibro_jupyter.widgets.study_panel import StudyPanel, best_so_far, parallel_axes

pytestmark = pytest.mark.fast


def _trial(tid: str, status: str, units: int, lr: float, score: float | None, message: str | None = None) -> dict:
    return {
        "trial_id": tid,
        "job_id": f"job-{tid}",
        "status": status,
        "values": {"units": units, "lr": lr, "tuner/epochs": 2},
        "score": score,
        "message": message,
        "metrics": {},
        "best_step": 1 if score is not None else None,
    }


def _study(status: str = "RUNNING", trials: list[dict] | None = None) -> Study:
    return Study.model_validate(
        {
            "study_id": "study-x",
            "status": status,
            "description": "",
            "message": None,
            "kind": "RandomSearch",
            "objective": [{"name": "val_accuracy", "direction": "max"}],
            "max_trials": 5,
            "parallel": 2,
            "created": 100.0,
            "updated": 160.0,
            "cost": 0.0,
            "best_trial_id": "02",
            "trials": trials
            or [
                _trial("00", "COMPLETED", 16, 0.01, 0.81),
                _trial("01", "FAILED", 64, 0.001, None, "out of memory"),
                _trial("02", "COMPLETED", 32, 0.001, 0.93),
                _trial("03", "COMPLETED", 8, 0.01, 0.77),
                _trial("04", "RUNNING", 48, 0.01, None),
            ],
        }
    )


def _history(*losses: float) -> list[dict]:
    return [{"epoch": i + 1, "loss": loss} for i, loss in enumerate(losses)]


def test_the_trials_table_sorts_by_any_column_and_marks_the_best() -> None:
    panel = StudyPanel("study-x")
    panel.update(_study(), {})
    assert panel.rows == ["00", "01", "02", "03", "04"]
    assert set(panel.sort_by.options) == {"trial", "status", "val_accuracy", "units", "lr"}, "no tuner/ bookkeeping"
    panel.sort_by.value = "val_accuracy"
    assert panel.rows == ["03", "00", "02", "01", "04"], "ascending, the unscored ones last"
    panel.descending.value = True
    assert panel.rows == ["02", "00", "03", "01", "04"], "descending, the unscored ones still last"
    panel.sort_by.value = "units"
    assert panel.rows == ["01", "04", "02", "00", "03"]
    assert "<tr data-trial='02' class='aibro-nb-best'>" in panel.table.value
    assert "out of memory" in panel.table.value, "a failed trial says why"
    assert "best val_accuracy <b>0.9300</b> (trial 02)" in panel.summary.value
    assert "4/5 trials done" in panel.summary.value


def test_best_so_far_only_improves_in_the_objectives_direction() -> None:
    study = _study()
    assert best_so_far(study) == [(0, 0.81), (2, 0.93), (3, 0.93)], "by trial id, failed ones left out"
    study = study.model_copy(update={"objective": [{"name": "val_loss", "direction": "min"}]})
    assert best_so_far(study) == [(0, 0.81), (2, 0.81), (3, 0.77)]


def test_parallel_coordinates_place_every_scored_trial_on_each_axis() -> None:
    scored = [t for t in _study().trials if t.score is not None]
    axes = parallel_axes(scored, "val_accuracy")
    assert [a[0] for a in axes] == ["lr", "units", "val_accuracy"]
    lr, units, objective = (a[1] for a in axes)
    assert lr == [1.0, 0.0, 1.0] and units == [pytest.approx(8 / 24), 1.0, 0.0]
    assert objective == [pytest.approx(0.25), 1.0, 0.0] and axes[2][2:] == ("0.77", "0.93")
    panel = StudyPanel("study-x")
    panel.update(_study(), {})
    lines, ticks, labels = panel._coords
    assert len(lines.y) == 3 and all(len(row) == 3 for row in lines.y), "one line per scored trial, 3 axes"
    assert lines.colors[1] == "#2ca02c" and lines.colors[2] == "#d62728", "best green, worst red"
    assert list(labels.text[:3]) == ["lr", "units", "val_accuracy"]


def test_the_loss_chart_draws_each_trial_and_a_final_study_offers_no_buttons() -> None:
    panel = StudyPanel("study-x")
    panel.update(_study(), {"00": _history(1.0, 0.5), "04": _history(2.0, 1.5, 1.2)})
    marks = panel.loss_chart.marks
    assert [list(m.x) for m in marks] == [[1, 2], [1, 2, 3]]
    assert list(marks[1].colors) != list(marks[0].colors) and "trial 04" in panel.loss_legend.value
    assert "1 ended" in panel.loss_legend.value
    assert panel.cancel_button.layout.display != "none"
    panel.update(_study("COMPLETED"), {})
    assert panel.cancel_button.layout.display == "none" and panel.detach_button.layout.display == "none"
    assert "cost $0.00 · elapsed 60s" == panel.cost.value
    panel.cell_done("best_model holds trial 02's trained model")
    assert "CELL DONE" in panel.state.value and "trial 02" in panel.result.value


def test_detach_stops_the_panel_and_says_how_to_follow_again() -> None:
    panel = StudyPanel("study-x", attach_hint="%cloud_attach study-x --tuner tuner")
    panel.update(_study(), {})
    panel.detach()
    panel.update(_study("COMPLETED"), {})
    assert "DETACHED" in panel.state.value and "%cloud_attach study-x --tuner tuner" in panel.state.value
    assert "RUNNING" in panel.summary.value, "a detached panel keeps still"


def test_cancel_asks_once_and_greys_the_button() -> None:
    asked: list[str] = []
    panel = StudyPanel("study-x")
    panel.on_cancel(lambda: asked.append("cancel"))
    panel.update(_study(), {})
    panel.cancel_button.click()
    assert asked == ["cancel"] and panel.cancel_button.disabled and panel.canceled.is_set()


def test_a_running_trial_draws_its_batches_dashed_until_its_epoch_ends() -> None:
    panel = StudyPanel("study-x")
    first = [{"epoch": 1, "batch": b, "steps": 100, "loss": 2.0 - b / 100} for b in (25, 50)]
    panel.update(_study(), {"04": first})
    (dashed,) = panel.loss_chart.marks
    assert dashed.line_style == "dashed" and list(dashed.x) == [0.25, 0.5], "part of the way to epoch 1"
    assert "trial 04" in panel.loss_legend.value and "the epoch in progress" in panel.loss_legend.value
    second = {"epoch": 2, "batch": 50, "steps": 100, "loss": 1.2}
    panel.update(_study(), {"04": _history(1.5) + [second, {"epoch": 2, "batch": 60, "steps": None, "loss": 1.1}]})
    solid, dashed = panel.loss_chart.marks
    assert list(solid.x) == [1] and solid.line_style != "dashed"
    assert list(dashed.x) == [1, 1.5] and list(dashed.y) == [1.5, 1.2], "on from epoch 1's point; no length: left out"
    panel.update(_study(), {"00": _history(1.0) + [second]})
    assert [m.line_style for m in panel.loss_chart.marks].count("dashed") == 1, "an ended trial draws no batches"


def test_a_trials_table_longer_than_its_box_says_it_scrolls() -> None:
    panel = StudyPanel("study-x")
    panel.update(_study(), {})
    assert "caption'>5 trials</div>" in panel.table.value and "scroll the table" not in panel.table.value
    panel.update(_study(trials=[_trial(f"{i:02d}", "COMPLETED", 8 * i, 0.01, i / 12) for i in range(12)]), {})
    assert panel.table.value.count("<tr data-trial") == 12
    assert "12 trials: 8 in view, scroll the table for the other 4" in panel.table.value
