"""A worker's event batch read without pydantic when every event is a batch or epoch event of the plain shape the
worker sends many times a second.

Under a team's load the models' checks of a 50-event batch (`models.WorkerEvents`: strict types, per-field
validators in Python) cost about as much of the event loop as the batch's insert. This reader accepts only what
those models accept, and gives the same payloads; anything else (another event type, a float where an integer
goes, a missing field, any value out of range) returns None and the models decide, so every refusal is still
worded by them. tests/test_worker_batch.py checks the two agree on generated batches.
"""

from __future__ import annotations

import math
from typing import Any

from aibro_core.models import INT64_MAX, MAX_EPOCHS, MAX_EVENT_BATCH, MAX_LOG_KEY_CHARS, MAX_LOG_KEYS, MAX_TIMESTAMP

from ..storage.events import NewEvent

_EVENT_KEYS = frozenset({"wseq", "ts", "type", "data"})
_BATCH_KEYS = frozenset({"epoch", "batch", "steps", "logs"})
_EPOCH_KEYS = frozenset({"epoch", "epochs", "logs", "seconds", "samples_per_s", "ended"})
_EPOCH_REQUIRED = frozenset({"epoch", "epochs", "logs", "seconds"})


def read_fast(raw: Any) -> tuple[int, list[NewEvent]] | None:
    """(attempt, events) when the whole batch is plainly valid; None when the models must look."""
    if type(raw) is not dict or len(raw) != 2:
        return None
    attempt, events = raw.get("attempt"), raw.get("events")
    if not _int_in(attempt, 0, INT64_MAX) or type(events) is not list or len(events) > MAX_EVENT_BATCH:
        return None
    out: list[NewEvent] = []
    for ev in events:
        if type(ev) is not dict or not ev.keys() <= _EVENT_KEYS:
            return None
        wseq, ts, type_, data = ev.get("wseq"), ev.get("ts"), ev.get("type"), ev.get("data")
        if not _int_in(wseq, 1, INT64_MAX) or type(data) is not dict:
            return None
        if ts is not None:
            ts = _float_in(ts, 0.0, MAX_TIMESTAMP)
            if ts is None:
                return None
        payload = _batch_data(data) if type_ == "batch" else _epoch_data(data) if type_ == "epoch" else None
        if payload is None:
            return None
        out.append(NewEvent(type_, payload, wseq, ts))
    return attempt, out


def _batch_data(data: dict[str, Any]) -> dict[str, Any] | None:
    """BatchData's payload, its keys in the model's order (the log stores what the model would dump)."""
    if not data.keys() <= _BATCH_KEYS or not _int_in(data.get("epoch"), 0, MAX_EPOCHS):
        return None
    if not _int_in(data.get("batch"), 0, INT64_MAX):
        return None
    out: dict[str, Any] = {"epoch": data["epoch"], "batch": data["batch"]}
    if "steps" in data:
        if data["steps"] is not None and not _int_in(data["steps"], 1, INT64_MAX):
            return None
        out["steps"] = data["steps"]
    if "logs" in data:
        logs = _logs(data["logs"])
        if logs is None:
            return None
        out["logs"] = logs
    return out


def _epoch_data(data: dict[str, Any]) -> dict[str, Any] | None:
    """EpochData's payload, its keys in the model's order."""
    if not data.keys() <= _EPOCH_KEYS or not _EPOCH_REQUIRED <= data.keys():
        return None
    if not _int_in(data["epoch"], 0, MAX_EPOCHS) or not _int_in(data["epochs"], 1, MAX_EPOCHS):
        return None
    logs = _logs(data["logs"])
    seconds = _float_in(data["seconds"], 0.0, math.inf)
    if logs is None or seconds is None:
        return None
    out: dict[str, Any] = {"epoch": data["epoch"], "epochs": data["epochs"], "logs": logs, "seconds": seconds}
    for key, top in (("samples_per_s", math.inf), ("ended", MAX_TIMESTAMP)):
        if key in data:
            value = data[key]
            if value is not None:
                value = _float_in(value, 0.0, top)
                if value is None:
                    return None
            out[key] = value
    return out


def _logs(logs: Any) -> dict[str, float | None] | None:
    if type(logs) is not dict or len(logs) > MAX_LOG_KEYS:
        return None
    out: dict[str, float | None] = {}
    for key, value in logs.items():
        if type(key) is not str or len(key) > MAX_LOG_KEY_CHARS:
            return None
        if value is None:
            out[key] = None
            continue
        number = _float_in(value, -math.inf, math.inf)
        if number is None:
            return None
        out[key] = number
    return out


def _int_in(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _float_in(value: Any, low: float, high: float) -> float | None:
    """The value as a float when it is a finite JSON number in [low, high] (what a strict float field takes)."""
    if type(value) is float or (type(value) is int and -(2**1023) < value < 2**1023):
        number = float(value)
        if math.isfinite(number) and low <= number <= high:
            return number
    return None
