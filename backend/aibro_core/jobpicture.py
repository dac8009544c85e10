"""The one event → job-picture reduction (Python side): status, substatus, timeline, epochs, last batch, errors.

A job's event log is the truth; every watcher rebuilds what it shows from it, starting anywhere from seq 0. The
backend's job view and the history.json it writes, the kernel's progress panel and text lines, and `%cloud_result`
all apply events through `JobPicture.apply`, so they cannot disagree; the store's summary row of a job (status,
substatus, epochs_done) is this reduction over each batch it writes. The JupyterLab sidebar's reducer is its one
TypeScript counterpart (labextension/src/jobpicture.ts); tests/test_job_pictures.py runs both over the same logs
(tests/fixtures/event_logs.json).

It never raises on a malformed event: an event the backend stored before events were validated (an epoch without
`logs`, a status outside the vocabulary) is skipped, so one bad row cannot break the job list for good.
"""

from __future__ import annotations

import math
from typing import Any

from . import vocabulary as v


def _epoch_index(data: dict[str, Any]) -> int | None:
    epoch = data.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        return None
    return epoch


def _finite_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class JobPicture:
    """Everything a watcher knows about one job, from its events applied in order.

    `history` maps each epoch index (0-based) to that epoch's event data (`logs`, `seconds`, `samples_per_s`...);
    an epoch a resumed attempt ran again replaces the lost attempt's.
    """

    def __init__(self, status: str = v.QUEUING, substatus: str = v.REQUESTING_SERVER) -> None:
        self.status = status
        self.substatus = substatus
        self.timeline: list[dict[str, Any]] = []
        self.epochs: int | None = None
        self.history: dict[int, dict[str, Any]] = {}
        self.last_batch: dict[str, Any] | None = None
        self.errors: list[str] = []
        self.last_seq = 0

    def apply(self, ev: dict[str, Any]) -> bool:
        """Apply one event; False (and nothing changes but `last_seq`) when it is not one this picture can use."""
        seq = ev.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.last_seq = max(self.last_seq, seq)
        data = ev.get("data")
        if not isinstance(data, dict):
            return False
        type_ = ev.get("type")
        if type_ == v.EV_STATUS:
            status, substatus = data.get("status", self.status), data.get("substatus", self.substatus)
            if status not in v.JOB_STATUSES or substatus not in v.JOB_SUBSTATUSES:
                return False
            self.status, self.substatus = status, substatus
            self.timeline.append({"status": status, "substatus": substatus, "ts": _finite_or_none(ev.get("ts"))})
            return True
        if type_ == v.EV_EPOCH:
            epoch = _epoch_index(data)
            if epoch is None or not isinstance(data.get("logs"), dict):
                return False
            epochs = data.get("epochs")
            if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs > 0:
                self.epochs = epochs
            self.history[epoch] = data
            return True
        if type_ == v.EV_BATCH:
            if _epoch_index(data) is None or not isinstance(data.get("batch"), int):
                return False
            self.last_batch = data
            return True
        if type_ == v.EV_ERROR:
            self.errors.append(str(data.get("message", "")))
            return True
        return False

    def apply_all(self, events: list[dict[str, Any]]) -> JobPicture:
        for ev in events:
            self.apply(ev)
        return self

    @property
    def epochs_done(self) -> int:
        """Epochs finished so far: one past the highest epoch reported (a resumed attempt that runs an earlier
        epoch again does not take it back)."""
        return max(self.history) + 1 if self.history else 0

    @property
    def final(self) -> bool:
        return self.status in v.JOB_FINAL

    @property
    def error(self) -> str | None:
        """The last error a user should read, if any."""
        return self.errors[-1] if self.errors else None

    def epoch_logs(self) -> dict[int, dict[str, Any]]:
        """Each epoch's Keras logs (str → number or None), epochs in order."""
        return {e: self.history[e]["logs"] for e in sorted(self.history)}

    def history_keys(self) -> list[str]:
        keys: list[str] = []
        for logs in self.epoch_logs().values():
            keys += [k for k in logs if k not in keys]
        return keys

    def history_dict(self) -> dict[str, list[Any]]:
        """Keras' `History.history`: metric → one value per epoch (None where an epoch lacks it)."""
        logs = self.epoch_logs()
        return {k: [logs[e].get(k) for e in logs] for k in self.history_keys()}

    def keras_lists(self) -> dict[str, list[float]]:
        """Keras' own `History.history`: each epoch appends the keys its logs hold (validation metrics only on the
        epochs `validation_freq` ran it), and a value that was not finite (sent as null) is NaN again."""
        out: dict[str, list[float]] = {}
        for logs in self.epoch_logs().values():
            for k, x in logs.items():
                if k != "epoch":
                    out.setdefault(k, []).append(float("nan") if x is None else x)
        return out

    def history_rows(self) -> list[dict[str, Any]]:
        """One row per epoch, numbered from 1, with its logs: what the job view lists."""
        return [
            {"epoch": e + 1, **{k: _finite_or_none(x) for k, x in logs.items() if k != "epoch"}}
            for e, logs in self.epoch_logs().items()
        ]

    def keras_history(self) -> dict[str, Any]:
        """history.json: {"epoch": [0-based indices], "history": metric → values}."""
        return {"epoch": sorted(self.history), "history": self.history_dict()}
