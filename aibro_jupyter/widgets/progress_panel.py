"""The live progress panel of one job. It is displayed once, from the cell's thread; afterwards only its traits
change (from whatever thread follows the events), so it stays honest across threads and reconnects: a reloaded
page rebuilds it from the kernel's traits, so everything a user needs after the fit (the state of the cell, the
final metrics, what the code after the fit printed) lives in the panel, not only in the cell's text output."""

from __future__ import annotations

import html
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as w

from aibro_core import vocabulary as v

from ..prices import job_cost
from ..progress import JobView, Tee, format_logs, local_notice
from .followcontrols import FollowControls
from .style import SCROLL_ROWS, STYLE, text_class

STEPS = v.SUBSTATUS_ORDER
TRAIN_COLOR, VAL_COLOR = "#1f77b4", "#ff7f0e"  # readable on JupyterLab's light and dark backgrounds alike
RUNNING_NOTE = "this cell is still running (JupyterLab says Idle meanwhile, so that these buttons keep working)"


class ProgressPanel(FollowControls, w.VBox):
    """Status → substatus stepper, epoch and batch bars, all epochs' metrics, live curves, cost, Cancel and Detach,
    and a state line that says whether the cell still runs, is done, or was detached."""

    def __init__(self, job_id: str, description: str = "", machines: list[str] | None = None, workers: int = 1) -> None:
        self.job_id = job_id
        self.started = time.time()
        self._make_controls()
        self._ended_at: float | None = None
        self._last_view: JobView | None = None  # the final picture, for the result line
        self.header = w.HTML(STYLE + self._header_html(description, machines or [], workers))
        self.state = w.HTML()
        self.state.add_class("aibro-nb-state")
        self.stepper = w.HTML()
        self.notice = w.HTML("")  # what the client itself has to say, e.g. "backend unreachable, restarting…"
        self.epoch_bar = w.IntProgress(value=0, min=0, max=1, description="epoch", bar_style="info")
        self.epoch_label = w.Label("0/?")
        self.batch_bar = w.IntProgress(value=0, min=0, max=1, description="batch")
        self.batch_label = w.Label("")
        self.metrics = w.HTML()
        self.metrics.add_class("aibro-nb-metrics")
        self.legend = w.HTML(_legend_html())
        self.legend.add_class("aibro-nb-legend")
        self.log_scale = w.ToggleButton(value=False, description="log scale", icon="line-chart")
        self.log_scale.observe(lambda ch: self._set_log_scale(bool(ch["new"])), names="value")
        self.result = w.HTML()
        self.result.add_class("aibro-nb-result")
        self.cost = w.Label("cost — · elapsed 0s")  # "—" until the first event says what the machine costs
        self.placement = w.HTML("")  # the devices a multi-device fit trains on, and the batch each one gets
        self.figure, self.lines, self._scales = _make_figure()
        self.status = v.QUEUING
        self.substatus = v.REQUESTING_SERVER
        self._render_stepper()
        self._render_state()
        chart = w.VBox([w.HBox([self.legend, self.log_scale]), self.figure])
        super().__init__(
            [
                self.header,
                self.state,
                self.stepper,
                self.placement,
                self.notice,
                w.HBox([self.epoch_bar, self.epoch_label]),
                w.HBox([self.batch_bar, self.batch_label]),
                w.HBox([self.metrics, chart]),
                self.result,
                w.HBox([self.cost, self.cancel_button, self.detach_button]),
            ]
        )
        self.add_class("aibro-nb-panel")

    def detach(self) -> None:
        super().detach()
        self.epoch_bar.bar_style = ""

    def cell_done(self, output: str = "", error: str = "") -> None:
        """The cell finished: what the code after the fit printed (and its error, if any) goes into the panel, so a
        page reloaded mid-run still shows it (JupyterLab sends a running cell's later text to the old page)."""
        self.cell_state = "failed" if error else "done"
        parts = []
        if output.strip():
            parts.append(
                f"<div class='aibro-nb-caption'>after the fit, this cell printed:</div><pre>{html.escape(output)}</pre>"
            )
        if error:
            parts.append(f"<pre class='aibro-nb-error'>{html.escape(error)}</pre>")
        self.result.value = self._final_html() + "".join(parts)
        self._render_state()

    @contextmanager
    def after_fit(self) -> Iterator[None]:
        """Run the cell's code after the fit with its text mirrored into the panel; the panel then says the cell is
        done (or failed, with the error), and the exception still reaches the cell as usual."""
        buf: list[str] = []
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, buf), Tee(err, buf)
        try:
            yield
        except BaseException as exc:
            sys.stdout, sys.stderr = out, err
            self.cell_done("".join(buf), "".join(traceback.format_exception_only(type(exc), exc)).strip())
            raise
        sys.stdout, sys.stderr = out, err
        self.cell_done("".join(buf))

    def _header_html(self, description: str, machines: list[str], workers: int = 1) -> str:
        desc = f" — {html.escape(description)}" if description else ""
        gang = f" · {workers} workers" if workers > 1 else ""
        on = f" <small>on {html.escape(', '.join(machines))}{gang}</small>" if machines else ""
        return f"<div class='aibro-nb-header'><b>{html.escape(self.job_id)}</b>{desc}{on}</div>"

    def _render_state(self) -> None:
        job = html.escape(self.job_id)
        if self.cell_state == "detached":
            kind, text = (
                "warn",
                (
                    f"DETACHED — {job} keeps training on the backend; this panel no longer follows it. "
                    f"Follow it again with <code>%cloud_attach {job}</code>."
                ),
            )
        elif self.cell_state == "done":
            kind, text = "ok", f"CELL DONE — {html.escape(self.status)}; the code after the fit has run."
        elif self.cell_state == "failed":
            kind, text = "error", f"CELL FAILED — {html.escape(self.status)}; see the error below."
        else:
            kind, text = "running", f"RUNNING — {html.escape(RUNNING_NOTE)}"
        self.state.value = f"<div class='aibro-nb-banner aibro-nb-{kind}'>{text}</div>"

    def _render_stepper(self) -> None:
        done = STEPS.index(self.substatus) if self.substatus in STEPS else -1
        parts = []
        for i, step in enumerate(STEPS):
            if self.status == v.CANCELED and i > done:
                cls = "todo"
            elif i < done or (i == done and self.status == v.COMPLETED):
                cls = "done"
            elif i == done:
                cls = "now"
            else:
                cls = "todo"
            parts.append(f'<span class="aibro-nb-step-{cls}">{html.escape(step)}</span>')
        tail = ' → <span class="aibro-nb-step-canceled">CANCELED</span>' if self.status == v.CANCELED else ""
        steps = f"<code>{html.escape(self.status)}</code> " + " → ".join(parts) + tail
        self.stepper.value = f"<div class='aibro-nb-stepper'>{steps}</div>"

    def update(self, view: JobView, ev: dict[str, Any] | None = None) -> None:
        """Apply the job's state to the traits; safe to call from a background thread. A detached panel keeps still."""
        if self.detached.is_set():
            return
        self.status, self.substatus = view.status, view.substatus
        self._render_stepper()
        if ev is not None and ev["type"] == v.EV_LOG and (ev.get("data") or {}).get("replicas"):
            self.placement.value = f"<small>{html.escape(str(ev['data'].get('message', '')))}</small>"
        if ev is not None and local_notice(ev):
            cls = text_class("warn" if ev["data"].get("level") == "warning" else "ok")
            self.notice.value = f'<small class="{cls}">{html.escape(local_notice(ev) or "")}</small>'
        if view.epochs:
            self.epoch_bar.max = view.epochs
        self.epoch_bar.value = len(view.history)
        self.epoch_label.value = f"{len(view.history)}/{view.epochs or '?'}"
        if view.last_batch and not view.final:
            steps = view.last_batch.get("steps") or 1
            self.batch_bar.max = steps
            self.batch_bar.value = min(steps, int(view.last_batch["batch"]) + 1)
            self.batch_label.value = f"{int(view.last_batch['batch']) + 1}/{steps}"
        if ev is None or ev["type"] == v.EV_EPOCH:
            self._render_metrics(view)
            self._render_curves(view)
        if view.final:
            self._ended_at = self._ended_at or time.time()
            self.epoch_bar.bar_style = "success" if view.status == v.COMPLETED else "danger"
            if view.status == v.COMPLETED:
                self.batch_bar.value = self.batch_bar.max
                self.batch_label.value = f"{self.batch_bar.max}/{self.batch_bar.max}"
            self.hide_controls()
            self._last_view = view
            self.result.value = self._final_html(view)
        self._render_state()
        elapsed = (self._ended_at or time.time()) - self.started
        self.cost.value = f"cost {job_cost(view.cost, view.price_per_hour)} · elapsed {elapsed:.0f}s"

    def _final_html(self, view: JobView | None = None) -> str:
        """The job's result line: its final status, epochs and last epoch's metrics."""
        view = view or self._last_view
        if view is None:
            return ""
        logs = view.history[max(view.history)]["logs"] if view.history else {}
        metrics = f" · {html.escape(format_logs(logs))}" if logs else ""
        kind = "ok" if view.status == v.COMPLETED else "error"
        why = f" — {html.escape(str(view.errors[-1]))}" if view.errors and view.status != v.COMPLETED else ""
        return (
            f"<div class='aibro-nb-final aibro-nb-{kind}'><b>{html.escape(view.status)}</b> after "
            f"{len(view.history)}/{view.epochs or '?'} epochs{metrics}{why}</div>"
        )

    def _render_metrics(self, view: JobView) -> None:
        """Every epoch's metrics, newest first, in a box that scrolls (nothing is cut off)."""
        hist = view.history_dict()
        if not hist:
            return
        keys = list(hist)
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
        epochs = sorted(view.history)
        rows = []
        for j in reversed(range(len(epochs))):
            cells = "".join(f"<td>{_fmt(hist[k][j])}</td>" for k in keys)
            rows.append(f"<tr><td>{epochs[j] + 1}</td>{cells}</tr>")
        count = "1 epoch" if len(epochs) == 1 else f"all {len(epochs)} epochs, newest first"
        caption = count + (" (scroll for more)" if len(epochs) > SCROLL_ROWS else "")
        self.metrics.value = (
            f"<div class='aibro-nb-caption'>{caption}</div><div class='aibro-nb-scroll'><table class='aibro-nb-table'>"
            f"<thead><tr><th>epoch</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        )

    def _render_curves(self, view: JobView) -> None:
        hist = view.history_dict()
        xs = [e + 1 for e in sorted(view.history)]
        train = [_num(val) for val in hist.get("loss", [])]
        val = [_num(x) for x in hist.get("val_loss", [])]
        if self.lines is None:
            return
        x_scale, x_axis = self._scales["x"], self._scales["x_axis"]
        total = max(view.epochs or 0, len(xs), 1)
        with x_scale.hold_sync():
            x_scale.min, x_scale.max = 0.5, total + 0.5  # half an epoch of room: the end points show whole
        x_axis.tick_values = epoch_ticks(total)
        train_line, val_line = self.lines
        with train_line.hold_sync():
            train_line.x, train_line.y = xs, train
        if val:
            with val_line.hold_sync():
                val_line.x, val_line.y = xs, val

    def _set_log_scale(self, on: bool) -> None:
        """Loss falls by orders of magnitude: on a log axis the late epochs stay readable."""
        if self.lines is None:
            return
        scale = self._scales["log" if on else "linear"]
        for line in self.lines:
            line.scales = {"x": self._scales["x"], "y": scale}
        self._scales["y_axis"].scale = scale
        self._scales["y_axis"].label = "loss (log)" if on else "loss"

    @property
    def curve_points(self) -> int:
        return 0 if self.lines is None else len(self.lines[0].x)


def epoch_ticks(epochs: int, most: int = 10) -> list[int]:
    """Whole epoch numbers for the x-axis: every epoch up to `most`, else the multiples of a round step (2, 5, 10,
    20, 50, …)."""
    return whole_ticks(1, epochs, most)


def whole_ticks(low: int, high: int, most: int = 10) -> list[int]:
    """Whole numbers from `low` to `high` for an axis: each one while at most `most` fit, else the multiples of a
    round step (2, 5, 10, 20, 50, …) between them."""
    count = max(1, high - low + 1)
    step = next(s for m in (1, 10, 100, 1000, 10000) for s in (1 * m, 2 * m, 5 * m) if count / s <= most)
    return list(range(-(-low // step) * step, high + 1, step))


def _num(val: Any) -> float:
    return float(val) if val is not None else float("nan")


def _fmt(val: Any) -> str:
    return f"{val:.4f}" if isinstance(val, float) else html.escape(str(val))


def _legend_html() -> str:
    items = [(TRAIN_COLOR, "loss (train)"), (VAL_COLOR, "val_loss (validation)")]
    swatch = "<span class='aibro-nb-swatch' style='background:{}'></span>"
    return " ".join(f"<span class='aibro-nb-key'>{swatch.format(c)}{html.escape(t)}</span>" for c, t in items)


def _make_figure() -> tuple[Any, Any, dict[str, Any]]:
    try:
        import bqplot as bq
    except ImportError:  # curves are optional; the table carries the numbers
        return w.HTML(""), None, {}
    xs, ys, logs = bq.LinearScale(min=0.5, max=1.5), bq.LinearScale(min=0.0), bq.LogScale()  # a loss is >= 0
    train = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=[TRAIN_COLOR], labels=["loss"], marker="circle")
    val = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=[VAL_COLOR], labels=["val_loss"], marker="circle")
    x_axis = bq.Axis(scale=xs, side="bottom", label="epoch", tick_format="d", tick_values=[1])
    y_axis = bq.Axis(scale=ys, side="left", label="loss")
    fig = bq.Figure(
        marks=[train, val],
        axes=[x_axis, y_axis],
        layout=w.Layout(width="440px", height="260px"),
        fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 15},
    )
    return fig, (train, val), {"x": xs, "linear": ys, "log": logs, "x_axis": x_axis, "y_axis": y_axis}
