"""The live panel of one hyperparameter study (issue 27): its trials in a table the user sorts, the best score so
far trial by trial, each trial's loss as it trains, the hyperparameters against the objective (parallel
coordinates), what the study costs and how long it has run, and Cancel and Detach as on the fit panel. Like the
fit panel it is displayed once and afterwards only its traits change, from the thread that follows the study."""

from __future__ import annotations

import html
import math
import threading
import time
from typing import Any

import ipywidgets as w

from aibro_core import vocabulary as v
from aibro_core.models import Study, StudyTrial

from .followcontrols import FollowControls
from .progress_panel import whole_ticks
from .style import SCROLL_ROWS, STYLE

RUNNING_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
ENDED_COLOR = "#9e9e9e"
RULE_COLOR = "#bdbdbd"  # the parallel coordinates' axes
BEST_COLOR, WORST_COLOR = (44, 160, 44), (214, 39, 40)  # the parallel coordinates: best trial green, worst red
STUDY_STYLE = """<style>
.aibro-nb-table tr.aibro-nb-best td { font-weight: 700; color: var(--jp-success-color1); }
[data-jp-theme-light="true"] .aibro-nb-table tr.aibro-nb-best td { color: var(--jp-success-color0); }
.aibro-nb-study-charts { flex-wrap: wrap; gap: 8px; }
.aibro-nb-chart-title { color: var(--jp-ui-font-color2); font-size: var(--jp-ui-font-size0); margin: 2px 0 0 8px; }
</style>"""


def _objective(study: Study) -> tuple[str, str]:
    first = (study.objective or [{"name": "score", "direction": "min"}])[0]
    return str(first["name"]), str(first.get("direction") or "min")


def _shown_values(trial: StudyTrial) -> dict[str, Any]:
    """The trial's hyperparameters without KerasTuner's own bookkeeping (Hyperband's tuner/epochs and so on)."""
    return {k: val for k, val in trial.values.items() if not k.startswith("tuner/")}


def loss_points(rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """A trial's loss on the chart's epoch axis: an epoch's row at its number (1, 2, …), a batch of the epoch in
    progress part of the way there (batch 25 of 100 of epoch 1 at 0.25); a batch of an epoch whose length is not
    known yet is left out, as is a row without a loss."""
    xs, ys = [], []
    for row in rows:
        if row.get("loss") is None:
            continue
        if "batch" in row:
            if not row.get("steps"):
                continue
            xs.append(row["epoch"] - 1 + min(1.0, row["batch"] / row["steps"]))
        else:
            xs.append(float(row["epoch"]))
        ys.append(float(row["loss"]))
    return xs, ys


def trial_numbers(study: Study) -> list[int]:
    """Each trial's place on a chart's x-axis: its id where KerasTuner numbers them ("0", "1", …), else its order."""
    ids = [t.trial_id for t in study.trials]
    return [int(i) for i in ids] if all(i.isdigit() for i in ids) else list(range(len(ids)))


def best_so_far(study: Study) -> list[tuple[int, float]]:
    """(trial number, the best score up to and including it) for each trial that has a score, in trial order: the
    curve a search flattens along as it converges."""
    _name, direction = _objective(study)
    pick = min if direction == "min" else max
    out: list[tuple[int, float]] = []
    best: float | None = None
    for n, trial in zip(trial_numbers(study), study.trials, strict=True):
        if trial.score is None or trial.status != v.TRIAL_COMPLETED:
            continue
        best = trial.score if best is None else pick(best, trial.score)
        out.append((n, best))
    return out


def parallel_axes(trials: list[StudyTrial], objective: str) -> list[tuple[str, list[float], str, str]]:
    """One axis per hyperparameter and one for the objective: (name, each trial's value placed in 0..1, the label
    at 0, the label at 1). Numbers are placed between their least and greatest value, choices by their order."""
    names = sorted({k for t in trials for k in _shown_values(t)})
    axes = []
    for name in [*names, objective]:
        raw = [t.score if name == objective else _shown_values(t).get(name) for t in trials]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw if x is not None)
        if numeric:
            nums = [float(x) for x in raw if x is not None]
            low, high = (min(nums), max(nums)) if nums else (0.0, 1.0)
            span = (high - low) or 1.0
            placed = [0.5 if x is None or high == low else (float(x) - low) / span for x in raw]
            axes.append((name, placed, _fmt(low), _fmt(high)))
        else:
            order = sorted({str(x) for x in raw}, key=str)
            last = max(1, len(order) - 1)
            placed = [order.index(str(x)) / last if len(order) > 1 else 0.5 for x in raw]
            axes.append((name, placed, order[0], order[-1]))
    return axes


class StudyPanel(FollowControls, w.VBox):
    """The study's state, its trials (sortable), best-so-far, live loss and parallel-coordinates charts, cost and
    elapsed time, Cancel and Detach."""

    def __init__(self, study_id: str, description: str = "", attach_hint: str = "") -> None:
        self.study_id = study_id
        self.attach_hint = attach_hint or f"%cloud_attach {study_id}"
        self._make_controls()
        self._study: Study | None = None
        self._histories: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        desc = f" — {html.escape(description)}" if description else ""
        self.header = w.HTML(
            STYLE + STUDY_STYLE + f"<div class='aibro-nb-header'><b>{html.escape(study_id)}</b>{desc}</div>"
        )
        self.state = w.HTML()
        self.state.add_class("aibro-nb-state")
        self.summary = w.HTML()
        self.summary.add_class("aibro-nb-study-summary")
        self.sort_by = w.Dropdown(options=["trial"], value="trial", description="sort by")
        self.descending = w.ToggleButton(value=False, description="descending", icon="sort-amount-desc")
        self.sort_by.observe(lambda _ch: self._render_table(), names="value")
        self.descending.observe(lambda _ch: self._render_table(), names="value")
        self.table = w.HTML()
        self.table.add_class("aibro-nb-trials")
        self.best_chart, self._best_marks = _best_figure()
        self.loss_chart, self._loss = _loss_figure()
        self.loss_legend = w.HTML()
        self.coords_chart, self._coords = _coords_figure()
        for chart, name in ((self.best_chart, "best"), (self.loss_chart, "loss"), (self.coords_chart, "coords")):
            chart.add_class(f"aibro-nb-{name}-chart")
        self.coords_caption = w.HTML(_caption("hyperparameters against the objective: once a trial completes"))
        self.result = w.HTML()
        self.result.add_class("aibro-nb-result")
        self.cost = w.Label("cost $0.00 · elapsed 0s")
        charts = w.HBox(
            [
                w.VBox([w.HTML("<div class='aibro-nb-chart-title'>best so far</div>"), self.best_chart]),
                w.VBox(
                    [
                        w.HTML("<div class='aibro-nb-chart-title'>loss of each trial, by epoch</div>"),
                        self.loss_chart,
                        self.loss_legend,
                    ]
                ),
            ]
        )
        charts.add_class("aibro-nb-study-charts")
        self._render_state()
        super().__init__(
            [
                self.header,
                self.state,
                self.summary,
                w.HBox([self.sort_by, self.descending]),
                self.table,
                charts,
                self.coords_caption,
                self.coords_chart,
                self.result,
                w.HBox([self.cost, self.cancel_button, self.detach_button]),
            ]
        )
        self.add_class("aibro-nb-panel")
        self.add_class("aibro-nb-study")

    def cell_done(self, text: str, error: str = "") -> None:
        """The results are in the kernel (or could not be brought in): say what the cell bound, or why not."""
        self.cell_state = "failed" if error else "done"
        kind = "error" if error else "ok"
        self.result.value = f"<div class='aibro-nb-final aibro-nb-{kind}'>{html.escape(error or text)}</div>"
        self._render_state()

    def update(self, study: Study, histories: dict[str, list[dict[str, Any]]]) -> None:
        """The study as the backend has it, and the loss history of the trials fetched this time; safe to call from
        the following thread. A detached panel keeps still."""
        if self.detached.is_set():
            return
        with self._lock:
            self._study = study
            self._histories.update(histories)
            name, direction = _objective(study)
            hps = sorted({k for t in study.trials for k in _shown_values(t)})
            options = ["trial", "status", name, *hps]
            if list(self.sort_by.options) != options:
                keep = self.sort_by.value if self.sort_by.value in options else "trial"
                self.sort_by.options, self.sort_by.value = options, keep
            done = sum(t.status != v.TRIAL_RUNNING for t in study.trials)
            of = f"/{study.max_trials}" if study.max_trials else ""
            best = next((t for t in study.trials if t.trial_id == study.best_trial_id), None)
            best_text = (
                f"best {html.escape(name)} <b>{best.score:.4f}</b> (trial {html.escape(best.trial_id)})"
                if best
                else "no trial completed yet"
            )
            self.summary.value = (
                f"<div class='aibro-nb-summary'><code>{html.escape(study.status)}</code> "
                f"{html.escape(study.kind)} · objective {html.escape(name)} ({direction}) · {done}{of} trials done, "
                f"up to {study.parallel} at once · {best_text}</div>"
            )
            self._render_table()
            self._render_best(study)
            self._render_loss(study)
            self._render_coords(study)
            final = study.status in v.STUDY_FINAL
            if final:
                self.hide_controls()
            end = study.updated if final else time.time()
            self.cost.value = f"cost ${study.cost:.2f} · elapsed {max(0.0, end - study.created):.0f}s"
            self._render_state()

    @property
    def rows(self) -> list[str]:
        """The trial ids in the order the table shows them."""
        return [t.trial_id for t in self._sorted()]

    def _sorted(self) -> list[StudyTrial]:
        study = self._study
        if study is None:
            return []
        key, name = self.sort_by.value, _objective(study)[0]

        def value(t: StudyTrial) -> tuple[int, Any]:
            if key == "trial":
                return (0, t.trial_id)
            if key == "status":
                return (0, str(t.status))
            got = t.score if key == name else _shown_values(t).get(key)
            if got is None:
                return (1, "")  # no value: at the end either way
            return (0, (0, got) if isinstance(got, (int, float)) else (1, str(got)))

        present = [t for t in study.trials if value(t)[0] == 0]
        missing = [t for t in study.trials if value(t)[0] == 1]
        return sorted(present, key=value, reverse=self.descending.value) + missing

    def _render_table(self) -> None:
        study = self._study
        if study is None:
            return
        name = _objective(study)[0]
        hps = sorted({k for t in study.trials for k in _shown_values(t)})
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["trial", "status", *hps, name, "best epoch", "job"])
        rows = []
        for t in self._sorted():
            values = _shown_values(t)
            cells = [t.trial_id, t.status, *[_fmt(values.get(h, "")) for h in hps]]
            score = _fmt(t.score) if t.score is not None else (t.message or "")
            epoch = str(t.best_step + 1) if t.best_step is not None and t.score is not None else ""
            cells += [score, epoch, t.job_id]
            best = " class='aibro-nb-best'" if t.trial_id == study.best_trial_id else ""
            body = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
            rows.append(f"<tr data-trial='{html.escape(t.trial_id)}'{best}>{body}</tr>")
        self.table.value = (
            f"<div class='aibro-nb-caption'>{html.escape(table_caption(len(rows)))}</div>"
            f"<div class='aibro-nb-scroll'><table class='aibro-nb-table'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>"
        )

    def _render_best(self, study: Study) -> None:
        if self._best_marks is None:
            return
        curve, dots, axis = self._best_marks
        points = best_so_far(study)
        numbers = trial_numbers(study)
        scored = [
            (n, t.score)
            for n, t in zip(numbers, study.trials, strict=True)
            if t.status == v.TRIAL_COMPLETED and t.score is not None
        ]
        axis.tick_values = whole_ticks(min(numbers, default=0), max(numbers, default=0))
        xs, ys = curve.scales["x"], curve.scales["y"]
        with xs.hold_sync():  # half a trial of room each side: one trial alone is a point, not a collapsed axis
            xs.min, xs.max = min(numbers, default=0) - 0.5, max(numbers, default=0) + 0.5
        if scored:
            low, high = min(s for _n, s in scored), max(s for _n, s in scored)
            pad = (high - low) * 0.1 or abs(high) * 0.05 or 0.05
            with ys.hold_sync():
                ys.min, ys.max = low - pad, high + pad
        with curve.hold_sync():
            curve.x, curve.y = [p[0] for p in points], [p[1] for p in points]
        with dots.hold_sync():
            dots.x, dots.y = [p[0] for p in scored], [p[1] for p in scored]

    def _render_loss(self, study: Study) -> None:
        if self._loss is None:
            return
        scales, axis = self._loss
        import bqplot as bq

        marks, legend, ended = [], [], 0
        running = [t for t in study.trials if t.status == v.TRIAL_RUNNING]
        for t in study.trials:
            history = self._histories.get(t.trial_id) or []
            live = t in running
            xs, ys = loss_points([h for h in history if "batch" not in h])
            bx, by = loss_points([h for h in history if "batch" in h]) if live else ([], [])
            if not xs and not bx:
                continue
            color = RUNNING_COLORS[running.index(t) % len(RUNNING_COLORS)] if live else ENDED_COLOR
            if xs:
                marks.append(
                    bq.Lines(
                        x=xs,
                        y=ys,
                        scales=scales,
                        colors=[color],
                        stroke_width=2 if live else 1,
                        marker="circle" if live else None,
                        opacities=[1.0 if live else 0.6],
                    )
                )
            if bx:  # the epoch in progress, batch by batch, on from the last epoch's point
                bx, by = xs[-1:] + bx, ys[-1:] + by
                marks.append(bq.Lines(x=bx, y=by, scales=scales, colors=[color], stroke_width=2, line_style="dashed"))
            if live:
                swatch = f"<span class='aibro-nb-swatch' style='background:{color}'></span>"
                legend.append(f"<span class='aibro-nb-key'>{swatch}trial {html.escape(t.trial_id)}</span>")
            else:
                ended += 1
        last = max((math.ceil(h["epoch"]) for hs in self._histories.values() for h in hs), default=1)
        axis.tick_values = whole_ticks(1, last)
        if any(m.line_style == "dashed" for m in marks):
            legend.append("<span class='aibro-nb-key'>dashed: the epoch in progress, batch by batch</span>")
        if ended:
            swatch = f"<span class='aibro-nb-swatch' style='background:{ENDED_COLOR}'></span>"
            legend.append(f"<span class='aibro-nb-key'>{swatch}{ended} ended</span>")
        self.loss_chart.marks = marks
        self.loss_legend.value = f"<div class='aibro-nb-legend'>{' '.join(legend)}</div>"

    def _render_coords(self, study: Study) -> None:
        if self._coords is None:
            return
        lines, ticks, labels = self._coords
        name, direction = _objective(study)
        trials = [t for t in study.trials if t.status == v.TRIAL_COMPLETED and t.score is not None]
        if not trials:
            return
        self.coords_caption.value = _caption(f"hyperparameters against {name}, one line per completed trial")
        axes = parallel_axes(trials, name)
        xs = list(range(len(axes)))
        scores = [t.score for t in trials if t.score is not None]
        low, high = min(scores), max(scores)
        colors = []
        for s in scores:
            good = 0.5 if high == low else (high - s) / (high - low) if direction == "min" else (s - low) / (high - low)
            colors.append(_mix(good))
        with lines.hold_sync():
            lines.x = xs
            lines.y = [[axis[1][i] for axis in axes] for i in range(len(trials))]
            lines.colors = colors
        with ticks.hold_sync():
            ticks.x = [[i, i] for i in xs]
            ticks.y = [[0.0, 1.0] for _ in xs]
        with labels.hold_sync():
            labels.x = [*xs, *xs, *xs]
            labels.y = [1.16] * len(xs) + [1.04] * len(xs) + [-0.1] * len(xs)
            labels.text = [a[0] for a in axes] + [a[3] for a in axes] + [a[2] for a in axes]
        self._coords_scale.min, self._coords_scale.max = -0.4, len(xs) - 0.6

    @property
    def _coords_scale(self) -> Any:
        return self._coords[0].scales["x"]  # type: ignore[index]

    def _render_state(self) -> None:
        study = html.escape(self.study_id)
        status = html.escape(self._study.status) if self._study else v.STUDY_RUNNING
        if self.cell_state == "detached":
            kind, text = (
                "warn",
                f"DETACHED — {study} goes on with the backend; this panel no longer follows it. Follow it again "
                f"with <code>{html.escape(self.attach_hint)}</code>.",
            )
        elif self.cell_state == "done":
            kind, text = "ok", f"CELL DONE — the study is {status}; its results are in this kernel."
        elif self.cell_state == "failed":
            kind, text = "error", f"CELL FAILED — the study is {status}; see the error below."
        else:
            kind, text = (
                "running",
                "RUNNING — the backend runs the trials; this cell follows them (closing the notebook does not "
                "stop the study).",
            )
        self.state.value = f"<div class='aibro-nb-banner aibro-nb-{kind}'>{text}</div>"


def table_caption(trials: int) -> str:
    """What the trials table holds, and, past the rows its box shows, that it scrolls and how many rows are out of
    view."""
    count = "1 trial" if trials == 1 else f"{trials} trials"
    if trials <= SCROLL_ROWS:
        return count
    return f"{count}: {SCROLL_ROWS} in view, scroll the table for the other {trials - SCROLL_ROWS}"


def _caption(text: str) -> str:
    return f"<div class='aibro-nb-chart-title'>{html.escape(text)}</div>"


def _mix(good: float) -> str:
    """A colour between the worst trial's red (0) and the best's green (1)."""
    r, g, b = (round(lo + (hi - lo) * good) for lo, hi in zip(WORST_COLOR, BEST_COLOR, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _fmt(val: Any) -> str:
    if isinstance(val, float):
        return f"{val:.4g}"
    return str(val)


def _best_figure() -> tuple[Any, Any]:
    try:
        import bqplot as bq
    except ImportError:  # charts are optional; the table carries the numbers
        return w.HTML(""), None
    xs, ys = bq.LinearScale(), bq.LinearScale()
    curve = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=["#2ca02c"], interpolation="step-after")
    dots = bq.Scatter(x=[], y=[], scales={"x": xs, "y": ys}, colors=["#1f77b4"], default_size=24)
    x_axis = bq.Axis(scale=xs, side="bottom", label="trial", tick_format="d", tick_values=[0])
    fig = bq.Figure(
        marks=[curve, dots],
        axes=[x_axis, bq.Axis(scale=ys, side="left", label="objective")],
        layout=w.Layout(width="360px", height="220px"),
        fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 15},
    )
    return fig, (curve, dots, x_axis)


def _loss_figure() -> tuple[Any, Any]:
    try:
        import bqplot as bq
    except ImportError:
        return w.HTML(""), None
    scales = {"x": bq.LinearScale(), "y": bq.LinearScale(min=0.0)}
    x_axis = bq.Axis(scale=scales["x"], side="bottom", label="epoch", tick_format="d", tick_values=[1])
    fig = bq.Figure(
        marks=[],
        axes=[x_axis, bq.Axis(scale=scales["y"], side="left", label="loss")],
        layout=w.Layout(width="400px", height="220px"),
        fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 15},
    )
    return fig, (scales, x_axis)


def _coords_figure() -> tuple[Any, Any]:
    try:
        import bqplot as bq
    except ImportError:
        return w.HTML(""), None
    xs, ys = bq.LinearScale(min=-0.4, max=0.4), bq.LinearScale(min=-0.22, max=1.24)
    lines = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, stroke_width=2, marker="circle", marker_size=20)
    ticks = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, colors=[RULE_COLOR], stroke_width=1)
    labels = bq.Label(x=[], y=[], text=[], scales={"x": xs, "y": ys}, align="middle", default_size=12, colors=["#888"])
    fig = bq.Figure(
        marks=[ticks, lines, labels],
        axes=[],
        layout=w.Layout(width="760px", height="220px"),
        fig_margin={"top": 10, "bottom": 10, "left": 30, "right": 30},
    )
    return fig, (lines, ticks, labels)
