"""Turns a job's event stream into the picture a user watches: text lines here; widgets reuse JobView."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture


class JobView(JobPicture):
    """Everything a watcher knows about a job, rebuilt from its events (any watcher can start at seq 0).

    The reduction itself is aibro_core.jobpicture.JobPicture, the one the backend's job view uses too: status,
    substatus, timeline, `history` (epoch index → that epoch's event data), `last_batch`, `errors`, `last_seq`,
    `history_dict()`, `final`. A JobView adds the job id, the cost a watcher shows, and the hourly price of the
    machine the job runs on (None until a watcher learns it), which says whether a cost of 0 is "free" or "$0.00"
    (prices.job_cost)."""

    def __init__(self, job_id: str, status: str = v.QUEUING, substatus: str = v.REQUESTING_SERVER) -> None:
        super().__init__(status, substatus)
        self.job_id = job_id
        self.cost = 0.0
        self.price_per_hour: float | None = None

    def __repr__(self) -> str:
        return f"JobView({self.job_id!r}, {self.status!r}, {self.substatus!r}, epochs={len(self.history)})"


def local_notice(ev: dict[str, Any]) -> str | None:
    """The message of a notice the client itself made for its watchers (e.g. "backend unreachable, restarting…"),
    or None for an event from the backend. Such a notice carries the last seq seen, so JobView.apply keeps still."""
    d = ev.get("data") or {}
    return str(d.get("message", "")) if ev.get("type") == v.EV_LOG and d.get("local") else None


def worker_note(ev: dict[str, Any]) -> str | None:
    """A worker's log line meant for the user: environment progress while GEARING UP ENV (pip's lines), or a
    warning such as a TensorFlow/Keras version that differs from the kernel's."""
    d = ev.get("data") or {}
    if ev.get("type") != v.EV_LOG:
        return None
    if d.get("warning"):
        return f"warning: {d['warning']}"
    if d.get("stage"):
        return f"{d['stage']}: {d.get('message', '')}"
    if d.get("replicas"):
        return str(d.get("message", ""))
    return None


def printed(ev: dict[str, Any]) -> str | None:
    """A line the job's own code printed on the worker (a callback's print), shown as it would be locally."""
    d = ev.get("data") or {}
    return str(d.get("message", "")) if ev.get("type") == v.EV_LOG and d.get("stream") in STREAMS else None


STREAMS = ("stdout", "stderr")


def printed_to(ev: dict[str, Any], out: TextIO) -> TextIO:
    """Where a printed line goes in the kernel: stderr's lines to stderr, as they went on the worker."""
    return sys.stderr if (ev.get("data") or {}).get("stream") == "stderr" else out


def format_logs(logs: dict[str, Any]) -> str:
    return " - ".join(f"{k}: {val:.4f}" if isinstance(val, float) else f"{k}: {val}" for k, val in logs.items())


class TextProgress:
    """Prints status changes and one line per epoch, like Keras' own verbose=2."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def __call__(self, view: JobView, ev: dict[str, Any]) -> None:
        d = ev["data"]
        if ev["type"] == v.EV_STATUS:
            msg = f" ({d['message']})" if d.get("message") else ""
            print(f"[{view.job_id}] {d.get('status')} · {d.get('substatus')}{msg}", file=self.out, flush=True)
        elif ev["type"] == v.EV_EPOCH:
            print(
                f"Epoch {d['epoch'] + 1}/{d.get('epochs')} - {d.get('seconds', 0):.2f}s - {format_logs(d['logs'])}",
                file=self.out,
                flush=True,
            )
        elif ev["type"] == v.EV_ERROR and d.get("message"):
            print(f"[{view.job_id}] error: {d['message']}", file=self.out, flush=True)
        elif printed(ev) is not None:
            print(printed(ev), file=printed_to(ev, self.out), flush=True)
        elif local_notice(ev):
            print(f"[{view.job_id}] {local_notice(ev)}", file=self.out, flush=True)
        elif worker_note(ev):
            print(f"[{view.job_id}] {worker_note(ev)}", file=self.out, flush=True)


class Tee:
    """A text stream that writes to `stream` and keeps a copy."""

    def __init__(self, stream: TextIO, copy: list[str]) -> None:
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.append(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
