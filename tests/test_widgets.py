"""The widgets on their own, fed by a real job: the progress panel, the machine picker, the timeline chart."""

from __future__ import annotations

import math

import bqplot as bq
import pytest

from aibro_core import vocabulary as v
from aibro_jupyter.client import BackendClient
from aibro_jupyter.progress import JobView
from aibro_jupyter.training import Training
from aibro_jupyter.widgets.picker import MachinePicker
from aibro_jupyter.widgets.progress_panel import ProgressPanel
from aibro_jupyter.widgets.timeline import durations, timeline_chart

from conftest import make_model

EPOCHS = 3


@pytest.fixture(scope="module")
def done_job(client: BackendClient, digits) -> dict:  # noqa: ANN001
    x, y, xv, yv = digits
    job = Training(client).submit(
        make_model(),
        x[:600],
        y[:600],
        machine_ids="local-cpu",
        epochs=EPOCHS,
        batch_size=32,
        validation_data=(xv, yv),
        cool_down_period_s=600,
        description="widgets",
    )
    Training(client).watch(job["job_id"])
    return client.job(job["job_id"])


def test_panel_replays_a_whole_job_into_its_traits(client: BackendClient, done_job: dict) -> None:
    panel = ProgressPanel(done_job["job_id"], "widgets", done_job["machines"])
    view = JobView(done_job["job_id"])
    epoch_values, batch_bars = [], []
    for ev in client.events(done_job["job_id"])["events"]:
        view.apply(ev)
        panel.update(view, ev)
        if ev["type"] == v.EV_EPOCH:
            epoch_values.append(panel.epoch_bar.value)
        if ev["type"] == v.EV_BATCH:
            batch_bars.append((ev["data"], panel.batch_bar.value, panel.batch_bar.max, panel.batch_label.value))
    assert epoch_values == [1, 2, 3], "the epoch bar steps once per epoch"
    assert batch_bars, "the job emitted batch events"
    for data, value, maximum, label in batch_bars:
        assert (value, maximum, label) == (data["batch"] + 1, data["steps"], f"{data['batch'] + 1}/{data['steps']}")
    full = panel.batch_bar.max
    assert (panel.batch_bar.value, panel.batch_label.value) == (full, f"{full}/{full}"), "a completed job fills it"
    assert (panel.epoch_bar.max, panel.epoch_label.value, panel.epoch_bar.bar_style) == (3, "3/3", "success")
    train, val = panel.lines
    assert list(train.x) == [1, 2, 3] and list(val.x) == [1, 2, 3], "train and validation curves, one point per epoch"
    hist = view.history_dict()
    assert [round(float(a), 6) for a in train.y] == [round(b, 6) for b in hist["loss"]]
    assert [round(float(a), 6) for a in val.y] == [round(b, 6) for b in hist["val_loss"]]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert f"<th>{key}</th>" in panel.metrics.value
    assert f"{hist['val_accuracy'][-1]:.4f}" in panel.metrics.value, "the table shows the last epoch's numbers"
    assert "<code>COMPLETED</code>" in panel.stepper.value and "color:#999" not in panel.stepper.value
    assert panel.cancel_button.disabled and panel.detach_button.disabled, "nothing to cancel once the job ended"
    assert panel.cost.value.startswith("cost $0.00 · elapsed")


def test_panel_buttons(done_job: dict) -> None:
    panel = ProgressPanel("job-x", "", ["local-cpu"])
    calls = []
    panel.on_cancel(lambda: calls.append("cancel"))
    panel.detach_button.click()
    assert panel.detached.is_set() and not calls, "Detach never cancels"
    panel.cancel_button.click()
    assert calls == ["cancel"] and panel.canceled.is_set() and panel.cancel_button.disabled


def test_panel_stepper_mid_training_and_canceled() -> None:
    panel = ProgressPanel("job-y")
    view = JobView("job-y")
    view.status, view.substatus = v.TRAINING, v.SUB_TRAINING
    panel.update(view)
    bold = [s for s in panel.stepper.value.split("<span") if "font-weight:bold" in s]
    assert len(bold) == 1 and ">TRAINING</span>" in bold[0], "exactly the current step is highlighted"
    view.status, view.substatus = v.CANCELED, v.SUB_CANCELED
    panel.update(view)
    assert "CANCELED" in panel.stepper.value and panel.epoch_bar.bar_style == "danger"


def test_picker_lists_the_marketplace_and_starts_with_an_ordered_choice(client: BackendClient) -> None:
    offers = client.machines()
    picker = MachinePicker(offers, cool_down_s=120)
    for offer in offers:
        assert f"<code>{offer['machine_id']}</code>" in picker.table.value
    picker.start_button.click()  # nothing added: the highlighted machine is the choice
    assert picker.chosen == ([offers[0]["machine_id"]], 120.0) and picker.started.is_set()
    assert picker.start_button.disabled


def test_picker_orders_spot_and_on_demand() -> None:
    offers = [
        {
            "machine_id": m,
            "provider": "aws",
            "gpu_count": 1,
            "gpu_type": "T4",
            "vcpus": 4,
            "memory_gib": 16,
            "price_per_hour": p,
            "on_demand_price_per_hour": 0.526,
            "availability": "high",
        }
        for m, p in (("g4dn.xlarge", 0.16), ("g4dn.xlarge.od", 0.526), ("p3.2xlarge", 0.9))
    ]
    picker = MachinePicker(offers)
    assert list(picker.available.options) == ["g4dn.xlarge", "p3.2xlarge"], "on-demand is a toggle, not a row"
    picker.available.value = "p3.2xlarge"
    picker.add_button.click()
    picker.available.value, picker.kind.value = "g4dn.xlarge", "on-demand"
    picker.add_button.click()
    picker.add_button.click()  # the same machine twice is listed once
    picker.cool_down.value = 600
    picker.start_button.click()
    assert picker.chosen == (["p3.2xlarge", "g4dn.xlarge.od"], 600.0)


def test_picker_refuses_an_empty_choice() -> None:
    picker = MachinePicker([])
    picker.start_button.click()
    assert picker.chosen is None and not picker.started.is_set() and "add at least one machine" in picker.message.value


@pytest.mark.parametrize("chart", ["pie", "funnel"])
def test_plot_timeline_from_the_jobs_timestamps(done_job: dict, chart: str) -> None:
    fig = Training.plot_timeline(done_job["job_id"], chart)
    assert isinstance(fig, bq.Figure)
    timeline = done_job["timeline"]
    total = timeline[-1]["ts"] - timeline[0]["ts"]
    mark = fig.marks[0]
    if chart == "pie":
        assert isinstance(mark, bq.Pie)
        seconds = list(mark.sizes)
        names = [lab.rsplit(" ", 1)[0] for lab in mark.labels]
    else:
        assert isinstance(mark, bq.Bars) and mark.orientation == "horizontal"
        seconds, names = list(mark.y), list(mark.x)
    assert math.isclose(sum(seconds), total, abs_tol=0.01), "the parts add up to the job's whole time"
    assert names[0] == v.REQUESTING_SERVER and v.SUB_TRAINING in names and v.RETURNING in names
    assert dict(zip(names, seconds))[v.SUB_TRAINING] > 0


def test_timeline_of_a_running_job_counts_until_now_and_names_bad_charts() -> None:
    tl = [
        {"status": "QUEUING", "substatus": v.REQUESTING_SERVER, "ts": 100.0},
        {"status": "TRAINING", "substatus": v.SUB_TRAINING, "ts": 103.0},
    ]
    assert durations(tl, now=110.0) == [(v.REQUESTING_SERVER, 3.0), (v.SUB_TRAINING, 7.0)]
    with pytest.raises(ValueError, match="chart_type must be 'pie' or 'funnel'"):
        timeline_chart(tl, "bar")
