"""The timeline chart: how long a job spent in each substatus, from its timestamped status events."""

from __future__ import annotations

import time
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.models import TimelineEntry


def durations(timeline: list[TimelineEntry], now: float | None = None) -> list[tuple[str, float]]:
    """(substatus, seconds) in order, over the entries that have a time; the last state runs until `now` unless the
    job is final."""
    timed = [(e, e.ts) for e in timeline if e.ts is not None]
    out: list[tuple[str, float]] = []
    for (cur, start), nxt in zip(timed, [*timed[1:], None]):
        if nxt is None:
            if cur.status in v.JOB_FINAL:
                break
            end = now or time.time()
        else:
            end = nxt[1]
        name = str(cur.substatus)
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + end - start)
        else:
            out.append((name, max(0.0, end - start)))
    return out


def timeline_chart(timeline: list[TimelineEntry], chart_type: str = "pie") -> Any:
    """A bqplot pie, or a funnel (horizontal bars in order), of the time spent per substatus."""
    import bqplot as bq
    import ipywidgets as w

    if chart_type not in ("pie", "funnel"):
        raise ValueError(f"chart_type must be 'pie' or 'funnel', got {chart_type!r}")
    parts = durations(timeline)
    labels = [p[0] for p in parts]
    secs = [round(p[1], 3) for p in parts]
    layout = w.Layout(width="520px", height="320px")
    if chart_type == "pie":
        pie = bq.Pie(sizes=secs, labels=[f"{lab} {s:.1f}s" for lab, s in zip(labels, secs)], display_labels="outside")
        return bq.Figure(marks=[pie], title="time per substatus", layout=layout)
    xs, ys = bq.OrdinalScale(), bq.LinearScale()
    bars = bq.Bars(x=labels, y=secs, scales={"x": xs, "y": ys}, orientation="horizontal")
    axes = [bq.Axis(scale=xs, side="left"), bq.Axis(scale=ys, side="bottom", label="seconds")]
    return bq.Figure(
        marks=[bars],
        axes=axes,
        title="time per substatus",
        layout=layout,
        fig_margin={"top": 40, "bottom": 40, "left": 170, "right": 20},
    )
