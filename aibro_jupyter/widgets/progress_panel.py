"""The live progress panel of one job. It is displayed once, from the cell's thread; afterwards only its traits
change (from whatever thread follows the events), so it stays honest across threads and reconnects."""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as w

from aibro_core import vocabulary as v

from ..progress import JobView, local_notice

STEPS = v.SUBSTATUS_ORDER


class ProgressPanel(w.VBox):
    """Status → substatus stepper, epoch and batch bars, metrics table, live curves, cost, Cancel and Detach."""

    def __init__(self, job_id: str, description: str = "", machines: list[str] | None = None) -> None:
        self.job_id = job_id
        self.started = time.time()
        self.canceled = threading.Event()
        self.detached = threading.Event()
        self._on_cancel: Callable[[], None] | None = None
        self.header = w.HTML(self._header_html(description, machines or []))
        self.stepper = w.HTML()
        self.notice = w.HTML("")  # what the client itself has to say, e.g. "backend unreachable, restarting…"
        self.epoch_bar = w.IntProgress(value=0, min=0, max=1, description="epoch", bar_style="info")
        self.epoch_label = w.Label("0/?")
        self.batch_bar = w.IntProgress(value=0, min=0, max=1, description="batch")
        self.batch_label = w.Label("")
        self.metrics = w.HTML()
        self.cost = w.Label("cost $0.00 · elapsed 0s")
        self.cancel_button = w.Button(description="Cancel", button_style="danger", icon="stop")
        self.detach_button = w.Button(description="Detach", icon="unlink")
        self.cancel_button.on_click(lambda _b: self._cancel())
        self.detach_button.on_click(lambda _b: self.detached.set())
        self.figure, self.lines = _make_figure()
        self.status = v.QUEUING
        self.substatus = v.REQUESTING_SERVER
        self._render_stepper()
        super().__init__(
            [
                self.header,
                self.stepper,
                self.notice,
                w.HBox([self.epoch_bar, self.epoch_label]),
                w.HBox([self.batch_bar, self.batch_label]),
                w.HBox([self.metrics, self.figure]),
                w.HBox([self.cost, self.cancel_button, self.detach_button]),
            ]
        )

    def on_cancel(self, fn: Callable[[], None]) -> None:
        self._on_cancel = fn

    def _cancel(self) -> None:
        self.canceled.set()
        self.cancel_button.disabled = True
        if self._on_cancel:
            self._on_cancel()

    def _header_html(self, description: str, machines: list[str]) -> str:
        desc = f" — {html.escape(description)}" if description else ""
        return f"<b>{html.escape(self.job_id)}</b>{desc} <small>on {html.escape(', '.join(machines))}</small>"

    def _render_stepper(self) -> None:
        done = STEPS.index(self.substatus) if self.substatus in STEPS else -1
        parts = []
        for i, step in enumerate(STEPS):
            if self.status == v.CANCELED and i > done:
                style = "color:#999"
            elif i < done or (i == done and self.status == v.COMPLETED):
                style = "color:#2e7d32"
            elif i == done:
                style = "font-weight:bold;color:#1565c0"
            else:
                style = "color:#999"
            parts.append(f'<span style="{style}">{html.escape(step)}</span>')
        tail = ' → <span style="color:#c62828;font-weight:bold">CANCELED</span>' if self.status == v.CANCELED else ""
        self.stepper.value = f"<code>{html.escape(self.status)}</code> " + " → ".join(parts) + tail

    def update(self, view: JobView, ev: dict[str, Any] | None = None) -> None:
        """Apply the job's state to the traits; safe to call from a background thread."""
        self.status, self.substatus = view.status, view.substatus
        self._render_stepper()
        if ev is not None and local_notice(ev):
            color = "#ef6c00" if ev["data"].get("level") == "warning" else "#2e7d32"
            self.notice.value = f'<small style="color:{color}">{html.escape(local_notice(ev) or "")}</small>'
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
            self.epoch_bar.bar_style = "success" if view.status == v.COMPLETED else "danger"
            if view.status == v.COMPLETED:
                self.batch_bar.value = self.batch_bar.max
                self.batch_label.value = f"{self.batch_bar.max}/{self.batch_bar.max}"
            self.cancel_button.disabled = True
            self.detach_button.disabled = True
        self.cost.value = f"cost ${view.cost:.2f} · elapsed {time.time() - self.started:.0f}s"

    def _render_metrics(self, view: JobView) -> None:
        hist = view.history_dict()
        if not hist:
            return
        keys = list(hist)
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
        rows = []
        for i, e in enumerate(sorted(view.history)[-8:]):
            j = len(view.history) - min(8, len(view.history)) + i
            cells = "".join(f"<td>{_fmt(hist[k][j])}</td>" for k in keys)
            rows.append(f"<tr><td>{e + 1}</td>{cells}</tr>")
        self.metrics.value = f"<table><tr><th>epoch</th>{head}</tr>{''.join(rows)}</table>"

    def _render_curves(self, view: JobView) -> None:
        hist = view.history_dict()
        xs = [e + 1 for e in sorted(view.history)]
        train = [float(val) if val is not None else float("nan") for val in hist.get("loss", [])]
        val = [float(x) if x is not None else float("nan") for x in hist.get("val_loss", [])]
        if self.lines is None:
            return
        train_line, val_line = self.lines
        with train_line.hold_sync():
            train_line.x, train_line.y = xs, train
        if val:
            with val_line.hold_sync():
                val_line.x, val_line.y = xs, val

    @property
    def curve_points(self) -> int:
        return 0 if self.lines is None else len(self.lines[0].x)


def _fmt(val: Any) -> str:
    return f"{val:.4f}" if isinstance(val, float) else html.escape(str(val))


def _make_figure() -> tuple[Any, Any]:
    try:
        import bqplot as bq
    except ImportError:  # curves are optional; the table carries the numbers
        return w.HTML(""), None
    xs, ys = bq.LinearScale(), bq.LinearScale()
    train = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=["#1565c0"], labels=["loss"], display_legend=True)
    val = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=["#ef6c00"], labels=["val_loss"], display_legend=True)
    fig = bq.Figure(
        marks=[train, val],
        axes=[
            bq.Axis(scale=xs, side="bottom", label="epoch", tick_format="d"),
            bq.Axis(scale=ys, side="left", label="loss"),
        ],
        layout=w.Layout(width="420px", height="260px"),
        fig_margin={"top": 20, "bottom": 40, "left": 50, "right": 10},
    )
    return fig, (train, val)
