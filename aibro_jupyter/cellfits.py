"""Runs a %%cloud_fit cell whose one fit is no statement of its own (cellsplit.FitInBlock): in a for/while loop, an
if, a with, a try, or inside an expression, as keras.io's addition RNN and character-level LSTM examples train
(`for epoch in ...: model.fit(..., epochs=1)`, then predict with the model just trained).

The cell runs in the kernel as written; each time its code reaches the fit, `CellFits.fit` submits that fit as a
job of its own, follows it with its own panel, puts the trained weights and optimizer state back into the same
model object and returns the job's History (so `model.history` is that History too), before the cell's next
statement runs.

* Waiting. The cell is compiled as a coroutine (cellsplit.rewrite_fit) and every fit is awaited on the kernel's
  loop, as a single fit is (cellwait.py), not followed by a blocking call: so the panel's Cancel and Detach work
  in every pass and Ctrl-C detaches. A detach, a cancel or a job that ends without completing raises
  `CellStopped`, a BaseException like KeyboardInterrupt, so that no `except Exception` of the cell carries on
  into the next job: the cell ends there, saying where.
* The panel. Each job has its panel (its id, its Cancel and Detach), shown where the first one was: a new job's
  panel replaces the last one's in the output (a display id), and what the old panel held is closed, so a
  30-pass loop leaves one panel and not 30 charts. The text output is what a single fit prints, each job's epoch
  lines (a worker's note, such as a version warning, once per cell), between what the cell itself prints.
* Warm machines. A fit in a loop keeps its machine warm for the next pass: unless --cool-down (or the session's
  `%cloud_machines --cool-down`) says otherwise, each job's cool-down is LOOP_COOL_DOWN_S, or twice the longest
  time yet seen between one job's end and the next one's start when that is longer; an explicit cool-down that
  proves shorter than that time is named once, with the value to pass.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, TextIO

from IPython.display import display

from aibro_core import vocabulary as v

from .cellsplit import FitInBlock
from .errors import JobFailed, ValidationError
from .progress import Tee

LOOP_COOL_DOWN_S = 300.0  # covers the local work of a pass in keras.io's looped examples (a few predictions)
MAX_LOOP_COOL_DOWN_S = 3600.0  # the backend's default cap on a warm machine (policy.max_cool_down_s)


class CellStopped(BaseException):
    """The cell ends at a fit that was detached, canceled or failed; `error` says whether the cell fails."""

    def __init__(self, message: str, error: bool) -> None:
        super().__init__(message)
        self.message, self.error = message, error


class CellFits:
    """One run of a FitInBlock cell: its fits, their panels, and the machine and cool-down they share."""

    def __init__(self, magics: Any, args: Any, plan: FitInBlock, helper: str) -> None:
        self.magics, self.args, self.plan, self.helper = magics, args, plan, helper
        self.count = 0  # fits reached so far
        self.panel: Any = None  # the last job's panel
        self.handle: Any = None  # where the panels show
        self.mirror = _Mirror()
        self.notes: set[str] = set()
        self.machines: str | None = args.machine or ",".join(magics.default_machines or []) or None
        explicit = args.cool_down if args.cool_down is not None else magics.default_cool_down
        self.explicit_cool_down: float | None = explicit
        self.ended_at: float | None = None
        self.gaps: list[float] = []  # seconds between one job's end and the next one's creation
        self.told = False

    async def run(self) -> Any:
        """Run the cell; the value of its final expression, as a cell's; None when a fit was detached."""
        if self.args.detach:
            raise ValidationError(
                f"line {self.plan.line}: --detach returns before the job's History exists, and this cell's fit "
                "(in a block) needs it to go on: leave --detach out, or make the fit a statement of its own"
            )
        ns = self.magics.shell.user_ns
        ns[self.helper] = self.fit
        try:
            coro = eval(self.plan.code, ns)  # noqa: S307 - the user's own cell, in their kernel
            if coro is not None:
                await coro
        except CellStopped as stop:
            self.mirror.stop()
            if not stop.error:
                print(stop.message, flush=True)
                return None
            self._done(stop.message)
            raise JobFailed(stop.message) from None
        except BaseException as exc:
            self._done("".join(traceback.format_exception_only(type(exc), exc)).strip())
            raise
        finally:
            ns.pop(self.helper, None)
        self._done()
        return ns.pop(self.plan.last, None) if self.plan.last else None

    async def fit(self, receiver: Any, /, *args: Any, **kwargs: Any) -> Any:
        """What the cell's `receiver.fit(*args, **kwargs)` became: the fit as a job; its History."""
        from .magics import bind_fit, keras_model

        self.mirror.stop()
        self.count += 1
        model = keras_model(receiver, self.plan.receiver)
        fit_args = bind_fit(args, kwargs)
        if self.machines is None:
            self.machines, self.explicit_cool_down = await self.magics._pick(self._cool_down())
        cool_down = self._cool_down()
        job = self.magics._submit(self.args, model, self.plan.receiver, fit_args, self.machines, cool_down)
        job_id = job.job_id
        self._gap(cool_down)
        if self.count == 1 and self.plan.looped and self.explicit_cool_down is None:
            print(
                f"each pass of this loop's fit is a job of its own; its machine stays warm {cool_down:g} s for the "
                "next (--cool-down S sets it)",
                flush=True,
            )
        label = f"fit {self.count} of this cell" + (f" — {job.description}" if job.description else "")
        view = await self.magics._follow(
            job_id, label, job.machines, quiet=self.args.quiet, show=self._show, notes=self.notes, workers=job.workers
        )
        where = f"the cell stopped at its fit on line {self.plan.line} (fit {self.count}); the rest of it did not run"
        if view is None:
            raise CellStopped(where, error=False)  # the detach itself was said by the follow
        try:
            trained, history = self.magics.trainer.collect(
                view, model, not self.args.unsafe, self.args.ckpt_dir, self.args.log_dir
            )
        except JobFailed as exc:
            if view.status == v.COMPLETED:
                raise
            raise CellStopped(f"{exc}; {where}", error=True) from None
        if self.args.into:
            self.magics.shell.user_ns[self.args.into] = trained
        self.ended_at = time.monotonic()
        self.mirror.start()
        return history

    def _cool_down(self) -> float:
        if self.explicit_cool_down is not None:
            return self.explicit_cool_down
        if not self.plan.looped:
            return 0.0  # a fit that runs once (in an if, a with, a try) cools as a top-level one does
        longest = max(self.gaps, default=0.0)
        return float(min(MAX_LOOP_COOL_DOWN_S, max(LOOP_COOL_DOWN_S, round(2 * longest + 30))))

    def _gap(self, cool_down: float) -> None:
        """Note the time since the last job ended; say once when an explicit cool-down proved shorter."""
        if self.ended_at is None:
            return
        gap = time.monotonic() - self.ended_at
        self.gaps.append(gap)
        if self.explicit_cool_down is not None and gap > cool_down and not self.told:
            self.told = True
            print(
                f"fit {self.count} started {gap:.0f} s after fit {self.count - 1} ended, longer than the cool-down of "
                f"{cool_down:g} s, so its machine may have closed: --cool-down {round(2 * gap + 30)} keeps it warm",
                file=sys.stderr,
                flush=True,
            )

    def _show(self, panel: Any) -> None:
        """The job's panel, in the place of the last job's. What the last one held is closed, nothing shows it now,
        but not its own (empty) box: JupyterLab's renderer of a display hides whatever it shows when the model it
        first rendered there closes, the new panel included."""
        if self.handle is None:
            self.handle = display(panel, display_id=True)
        else:
            self.handle.update(panel)
            held, self.panel.children = self.panel.children, ()
            for widget in held:
                _close_widgets(widget)
        self.panel = panel

    def _done(self, error: str = "") -> None:
        """The cell ended: the last job's panel says so, with what the cell printed after that job's fit."""
        printed = self.mirror.stop()
        if self.panel is not None and not self.panel.detached.is_set():
            self.panel.cell_done(printed, error)


def _close_widgets(root: Any) -> None:
    """Close a widget and every widget it holds (children, a figure's marks, axes and scales, layouts)."""
    import ipywidgets as w

    seen: set[int] = set()
    todo = [root]
    while todo:
        widget = todo.pop()
        if id(widget) in seen:
            continue
        seen.add(id(widget))
        for value in widget.trait_values().values():
            values = value if isinstance(value, (list, tuple)) else [value]
            todo.extend(x for x in values if isinstance(x, w.Widget))
        widget.close()


class _Mirror:
    """What the cell prints after its latest fit, also kept for that fit's panel, as after a single fit: a page
    reloaded mid-run (whose cell output stops at the reload) still shows it."""

    def __init__(self) -> None:
        self.buf: list[str] = []
        self.streams: tuple[TextIO, TextIO] | None = None

    def start(self) -> None:
        self.stop()
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = Tee(sys.stdout, self.buf), Tee(sys.stderr, self.buf)  # type: ignore[assignment]

    def stop(self) -> str:
        """Stop mirroring; what was mirrored since `start`."""
        if self.streams is not None:
            if isinstance(sys.stdout, Tee):  # unless the cell's own code has put another stream there
                sys.stdout = self.streams[0]
            if isinstance(sys.stderr, Tee):
                sys.stderr = self.streams[1]
            self.streams = None
        text = "".join(self.buf)
        self.buf.clear()
        return text
