"""The widgets on their own, fed by a real job: the progress panel, the machine picker, the timeline chart."""

from __future__ import annotations

import math

import bqplot as bq
import ipywidgets as w
import pytest

from aibro_core import vocabulary as v
from aibro_core.models import Job, Machine, Prediction, TimelineEntry
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.prices import job_cost
from aibro_jupyter.progress import JobView
from aibro_jupyter.training import Training
from aibro_jupyter.widgets.picker import COLUMNS, MachinePicker, marketplace_rows
from aibro_jupyter.widgets.progress_panel import ProgressPanel, epoch_ticks
from aibro_jupyter.widgets.timeline import durations, timeline_chart

from conftest import make_model

pytestmark = pytest.mark.fast

EPOCHS = 3


@pytest.fixture(scope="module")
def done_job(client: BackendClient, digits) -> Job:  # noqa: ANN001
    x, y, xv, yv = digits
    job = Training(client).submit(
        FitRequest(
            make_model(),
            x[:600],
            y[:600],
            machine_ids="local-cpu",
            epochs=EPOCHS,
            batch_size=32,
            validation_data=(xv, yv),
            cool_down_period_s=600,
            description="widgets",
        ),
    )
    Training(client).watch(job.job_id)
    return client.job(job.job_id)


def test_panel_replays_a_whole_job_into_its_traits(client: BackendClient, done_job: Job) -> None:
    panel = ProgressPanel(done_job.job_id, "widgets", done_job.machines)
    view = JobView(done_job.job_id)
    view.price_per_hour = next(m.price_per_hour for m in client.machines() if m.machine_id == done_job.machine_id)
    epoch_values, batch_bars = [], []
    for ev in client.events(done_job.job_id)["events"]:
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
    assert [t for t in panel.figure.axes[0].tick_values] == [1, 2, 3], "whole epochs on the x-axis"
    hist = view.history_dict()
    assert [round(float(a), 6) for a in train.y] == [round(b, 6) for b in hist["loss"]]
    assert [round(float(a), 6) for a in val.y] == [round(b, 6) for b in hist["val_loss"]]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert f"<th>{key}</th>" in panel.metrics.value
    assert f"{hist['val_accuracy'][-1]:.4f}" in panel.metrics.value, "the table shows the last epoch's numbers"
    assert "<code>COMPLETED</code>" in panel.stepper.value and "aibro-nb-step-todo" not in panel.stepper.value
    assert panel.cancel_button.disabled and panel.detach_button.disabled, "nothing to cancel once the job ended"
    assert panel.cancel_button.layout.display == panel.detach_button.layout.display == "none", "and not shown"
    assert panel.cost.value.startswith("cost free · elapsed"), "local-cpu costs nothing: free, as the sidebar says"
    assert "COMPLETED</b> after 3/3 epochs" in panel.result.value, "the panel carries the result line"
    assert f"val_accuracy: {hist['val_accuracy'][-1]:.4f}" in panel.result.value, "and the final metrics"
    assert "RUNNING" in panel.state.value, "the cell still runs until the code after the fit has"


def _epoch(k: int, epochs: int, loss: float) -> dict:
    logs = {"loss": loss, "val_loss": loss * 1.1}
    return {"type": v.EV_EPOCH, "seq": k + 1, "data": {"epoch": k, "epochs": epochs, "logs": logs}}


@pytest.mark.parametrize(
    ("epochs", "ticks"),
    [(1, [1]), (2, [1, 2]), (10, list(range(1, 11))), (12, [2, 4, 6, 8, 10, 12]), (30, [5, 10, 15, 20, 25, 30])],
)
def test_epoch_axis_ticks_are_whole_epochs(epochs: int, ticks: list[int]) -> None:
    assert epoch_ticks(epochs) == ticks
    panel = ProgressPanel("job-t")
    view = JobView("job-t")
    for k in range(epochs):
        view.apply(_epoch(k, epochs, 1.0 / (k + 1)))
        panel.update(view, _epoch(k, epochs, 1.0 / (k + 1)))
        axis = panel.figure.axes[0]
        assert list(axis.tick_values) == ticks and axis.tick_format == "d"
        scale = panel.lines[0].scales["x"]
        assert scale.min <= 1 and scale.max >= epochs, "the axis spans every epoch from the start"
    assert all(float(t).is_integer() for t in panel.figure.axes[0].tick_values)


def test_metrics_table_keeps_every_epoch_and_loss_can_go_log_scale() -> None:
    panel = ProgressPanel("job-m")
    view = JobView("job-m")
    for k in range(30):
        view.apply(_epoch(k, 30, 10.0**-k))
        panel.update(view, _epoch(k, 30, 10.0**-k))
    rows = panel.metrics.value.count("<tr>") - 1
    assert rows == 30 and "aibro-nb-scroll" in panel.metrics.value, "all 30 epochs, in a box that scrolls"
    assert panel.metrics.value.index("<td>30</td>") < panel.metrics.value.index("<td>1</td>"), "newest first"
    linear = panel.lines[0].scales["y"]
    panel.log_scale.value = True
    assert (
        isinstance(panel.lines[0].scales["y"], bq.LogScale) and panel.figure.axes[1].scale is panel.lines[0].scales["y"]
    )
    panel.log_scale.value = False
    assert panel.lines[1].scales["y"] is linear
    assert not any(getattr(m, "display_legend", False) for m in panel.figure.marks), "the legend is outside the plot"
    assert "loss (train)" in panel.legend.value and "val_loss (validation)" in panel.legend.value


def test_the_cost_line_says_free_only_where_nothing_is_billed() -> None:
    assert [job_cost(0.0, None), job_cost(0.0, 0.0), job_cost(0.0, 0.526), job_cost(0.0123, 0.526)] == [
        "free",
        "free",
        "$0.00",
        "$0.01",
    ], "the sidebar's jobCost: a priced machine that has billed nothing yet says $0.00"
    assert job_cost(0.0123, None) == "$0.01", "a billed job shows its dollars even where the offer is gone"
    panel, view = ProgressPanel("job-c"), JobView("job-c")
    assert panel.cost.value.startswith("cost — "), "nothing is known before the first event"
    view.price_per_hour, view.cost = 0.526, 0.0
    panel.update(view)
    assert panel.cost.value.startswith("cost $0.00 · elapsed")
    view.cost = 0.31
    panel.update(view)
    assert panel.cost.value.startswith("cost $0.31 · elapsed")


def test_panel_buttons(done_job: Job) -> None:
    panel = ProgressPanel("job-x", "", ["local-cpu"])
    calls = []
    panel.on_cancel(lambda: calls.append("cancel"))
    panel.cancel_button.click()
    assert calls == ["cancel"] and panel.canceled.is_set() and panel.cancel_button.disabled
    panel.detach_button.click()
    assert panel.detached.is_set() and calls == ["cancel"], "Detach never cancels"


def test_a_detached_panel_says_so_and_keeps_still() -> None:
    panel = ProgressPanel("job-d", "", ["local-cpu"])
    view = JobView("job-d")
    view.apply({"type": v.EV_STATUS, "seq": 1, "data": {"status": v.TRAINING, "substatus": v.SUB_TRAINING}})
    view.apply(_epoch(1, 10, 0.5))
    panel.update(view)
    panel.detach()
    assert "DETACHED" in panel.state.value and "%cloud_attach job-d" in panel.state.value
    assert panel.cancel_button.disabled and panel.detach_button.disabled, "nothing to press on a detached panel"
    assert "RUNNING" not in panel.state.value
    view.apply(_epoch(2, 10, 0.4))
    panel.update(view)
    assert panel.epoch_label.value == "1/10", "a detached panel no longer follows the job"


def test_after_fit_output_and_errors_land_in_the_panel(capsys: pytest.CaptureFixture) -> None:
    panel = ProgressPanel("job-a")
    view = JobView("job-a")
    view.apply(_epoch(0, 1, 0.25))
    view.apply({"type": v.EV_STATUS, "seq": 9, "data": {"status": v.COMPLETED, "substatus": v.SUB_COMPLETED}})
    panel.update(view)
    with panel.after_fit():
        print("final validation accuracy: 0.97 <b>")
    assert "final validation accuracy: 0.97" in capsys.readouterr().out, "the cell's output is untouched"
    assert "final validation accuracy: 0.97 &lt;b&gt;" in panel.result.value and "CELL DONE" in panel.state.value
    assert "COMPLETED</b> after 1/1 epochs · loss: 0.2500" in panel.result.value
    with pytest.raises(ZeroDivisionError), panel.after_fit():
        print("before")
        1 / 0  # noqa: B018
    assert "CELL FAILED" in panel.state.value and "ZeroDivisionError" in panel.result.value


def test_picker_lists_the_marketplace_and_starts_with_an_ordered_choice(client: BackendClient) -> None:
    offers = client.machines()
    picker = MachinePicker(offers, cool_down_s=120)
    assert "local-cpu" in picker.visible_rows
    cells = [c.value for c in picker.grid.children if isinstance(c, w.HTML)]
    assert any("<code>local-cpu</code>" in c for c in cells)
    picker.add_buttons["local-cpu"].click()
    picker.start_button.click()
    assert picker.chosen == (["local-cpu"], 120.0) and picker.started.is_set()
    assert picker.start_button.disabled
    assert len(picker.children) == 1 and "training on local-cpu" in picker.children[0].value, "it folds at Start"


def _offer(mid: str, price: float, gpus: int, vcpus: int, mem: float, spot: bool, avail: str = "available") -> Machine:
    return Machine.model_validate(
        {
            "machine_id": mid,
            "provider": "aws" if gpus else "local",
            "gpu_count": gpus,
            "gpu_type": "T4" if gpus else None,
            "vcpus": vcpus,
            "memory_gib": mem,
            "price_per_hour": price,
            "on_demand_price_per_hour": 0.526 if gpus else 0.0,
            "spot": spot,
            "availability": avail,
        }
    )


MARKET = [
    _offer("g4dn.xlarge", 0.16, 1, 4, 16, True),
    _offer("g4dn.xlarge.od", 0.526, 1, 4, 16, False),
    _offer("p3.8xlarge", 3.1, 4, 32, 244, True, "busy"),
    _offer("local-cpu", 0.0, 0, 2, 8, False),
]


def test_picker_reads_like_a_marketplace() -> None:
    rows = {r.machine: r for r in marketplace_rows(MARKET)}
    assert set(rows) == {"g4dn.xlarge", "p3.8xlarge", "local-cpu"}, "spot and on-demand of a machine share a row"
    assert rows["g4dn.xlarge"].spot == ("g4dn.xlarge", 0.16) and rows["g4dn.xlarge"].on_demand == (
        "g4dn.xlarge.od",
        0.526,
    )
    picker = MachinePicker(MARKET + [_offer("g5.xlarge.od", 1.006, 1, 4, 16, False)])
    assert picker.visible_rows == ["local-cpu", "g4dn.xlarge", "p3.8xlarge", "g5.xlarge"], "cheapest spot first"
    picker.sort_buttons["spot"].click()
    assert picker.visible_rows == ["p3.8xlarge", "g4dn.xlarge", "local-cpu", "g5.xlarge"], "no spot price: last"
    picker.sort_buttons["on-demand"].click()
    assert picker.visible_rows == ["local-cpu", "g4dn.xlarge", "g5.xlarge", "p3.8xlarge"], "no on-demand: last"
    cells = [c.value for c in picker.grid.children if isinstance(c, w.HTML)]
    local = cells.index("<code>local-cpu</code>")
    assert cells[local + 5 : local + 7] == ["free", "free"], "a machine that costs nothing says so, as the sidebar"
    picker = MachinePicker(MARKET)
    picker.sort_buttons["GPU"].click()
    assert picker.visible_rows[0] == "p3.8xlarge", "most GPUs first"
    picker.sort_buttons["GPU"].click()
    assert picker.visible_rows[0] == "local-cpu", "the same header again reverses"
    for key, first in (("vCPU", "p3.8xlarge"), ("memory", "p3.8xlarge"), ("availability", "g4dn.xlarge")):
        picker.sort_buttons[key].click()
        assert picker.visible_rows[0] == first, key
    assert "▼" in picker.sort_buttons["availability"].description
    labels = sorted(b.description for b in picker.add_buttons.values())
    assert labels == ["+ add", "+ on-demand", "+ spot", "+ spot"], "a free machine is added, not bought"
    cells = [c.value for c in picker.grid.children if isinstance(c, w.HTML)]
    assert "$0.160" in cells and "$0.526" in cells and "$3.100" in cells, "spot and on-demand prices side by side"
    with pytest.raises(ValueError, match="sort by one of spot, on-demand, GPU"):
        picker.sort_by("colour")


def test_the_picker_shows_a_fits_predicted_time_and_cost_and_sorts_by_them() -> None:
    def predicted(mid: str, seconds: float | None, cost: float | None, source: str | None) -> Prediction:
        return Prediction(machine_id=mid, seconds=seconds, cost=cost, source=source, basis=f"basis of {mid}")

    predictions = [
        predicted("g4dn.xlarge", 600.0, 0.027, "history"),
        predicted("g4dn.xlarge.od", 600.0, 0.088, "history"),
        predicted("p3.8xlarge", 130.0, 0.11, "flops"),
        predicted("local-cpu", None, None, None),
    ]
    assert "time" not in COLUMNS and "time" not in MachinePicker(MARKET).sort_buttons, "no fit, no prediction column"
    picker = MachinePicker(MARKET, predictions=predictions)
    heads = [b.description for b in picker.sort_buttons.values()]
    assert "time" in heads and "cost" in heads, heads
    cells = [c.value for c in picker.grid.children if isinstance(c, w.HTML)]
    gpu = cells.index("<code>g4dn.xlarge</code>")
    assert cells[gpu + 7 : gpu + 9] == [
        "<span title='history: basis of g4dn.xlarge'>10 min</span>",
        "<span title='history: basis of g4dn.xlarge'>$0.03</span>",
    ], "the spot variant's prediction, its source in the tooltip"
    big = cells.index("<code>p3.8xlarge</code>")
    assert [c.split(">")[1].split("<")[0] for c in cells[big + 7 : big + 9]] == ["~2 min", "~$0.11"], "a rough guess"
    local = cells.index("<code>local-cpu</code>")
    assert "basis of local-cpu'>—</span>" in cells[local + 7], "nothing known: a dash"
    picker.sort_buttons["time"].click()
    assert picker.visible_rows == ["p3.8xlarge", "g4dn.xlarge", "local-cpu"], "fastest first, unknown last"
    picker.sort_buttons["cost"].click()
    assert picker.visible_rows == ["g4dn.xlarge", "p3.8xlarge", "local-cpu"], "cheapest first, unknown last"


def test_picker_orders_spot_and_on_demand() -> None:
    picker = MachinePicker(MARKET)
    assert list(picker.order.options) == [], "several machines on offer: nothing is chosen for the user"
    picker.add_buttons["p3.8xlarge"].click()
    picker.add_buttons["g4dn.xlarge.od"].click()
    picker.add_buttons["g4dn.xlarge.od"].click()  # the same machine twice is listed once
    picker.add("g4dn.xlarge")
    picker.order.value = "g4dn.xlarge"
    picker.remove_button.click()
    picker.cool_down.value = 600
    picker.start_button.click()
    assert picker.chosen == (["p3.8xlarge", "g4dn.xlarge.od"], 600.0)


def test_picker_refuses_an_empty_choice() -> None:
    picker = MachinePicker([])
    picker.start_button.click()
    assert picker.chosen is None and not picker.started.is_set() and "add at least one machine" in picker.message.value


@pytest.mark.parametrize("chart", ["pie", "funnel"])
def test_plot_timeline_from_the_jobs_timestamps(done_job: Job, chart: str) -> None:
    fig = Training.plot_timeline(done_job.job_id, chart)
    assert isinstance(fig, bq.Figure)
    timeline = done_job.timeline
    total = timeline[-1].ts - timeline[0].ts
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
        TimelineEntry(status=v.QUEUING, substatus=v.REQUESTING_SERVER, ts=100.0),
        TimelineEntry(status=v.TRAINING, substatus=v.SUB_TRAINING, ts=103.0),
    ]
    assert durations(tl, now=110.0) == [(v.REQUESTING_SERVER, 3.0), (v.SUB_TRAINING, 7.0)]
    with pytest.raises(ValueError, match="chart_type must be 'pie' or 'funnel'"):
        timeline_chart(tl, "bar")
