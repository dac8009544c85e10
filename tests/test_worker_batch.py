"""The worker's event batches read without pydantic (aibro_backend/api/workerbatch.py): whatever that reader
accepts, the models accept too and turn into the same payloads, key order included (the log stores them as
JSON); whatever it is unsure of goes to the models, which word the refusal. And the worker's own batches do take
the fast path, or it saves nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aibro_backend.api.workerbatch import read_fast
from aibro_backend.worker.callbacks import clean_logs
from aibro_core.models import WorkerEvents

pytestmark = pytest.mark.fast

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 10**6, 10**6 + 1, 10**400, 1e11, 1e11 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 3.0, 1e308, math.nan, math.inf]),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
TIME_EDGES = st.sampled_from([-1.0, 1e11, 1e11 + 1e-4, 10**11, 10**11 + 1, 2e11])
LOG_KEYS = st.one_of(
    st.sampled_from(["loss", "accuracy", "val_loss", "x" * 200, "x" * 201, "é" * 200]), st.text(max_size=5)
)


@st.composite
def logs(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 40)) == 0:
        return draw(ODD_VALUES)
    values = st.one_of(st.none(), st.floats(), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False))
    return draw(st.dictionaries(LOG_KEYS, values, max_size=4))


@st.composite
def field(draw: st.DrawFn, good: st.SearchStrategy[Any]) -> Any:
    """Mostly a good value, sometimes anything."""
    return draw(ODD_VALUES) if draw(st.integers(0, 25)) == 0 else draw(good)


@st.composite
def event(draw: st.DrawFn) -> Any:
    type_ = draw(st.sampled_from(["batch"] * 4 + ["epoch"] * 4 + ["log", "nonsense"]))
    small = st.integers(0, 12)
    if type_ == "batch":
        data: dict[str, Any] = {"epoch": draw(field(small)), "batch": draw(field(small))}
        if draw(st.booleans()):
            data["steps"] = draw(field(st.one_of(st.none(), st.integers(0, 12))))
        if draw(st.booleans()):
            data["logs"] = draw(logs())
    else:
        data = {
            "epoch": draw(field(small)),
            "epochs": draw(field(st.integers(0, 12))),
            "logs": draw(logs()),
            "seconds": draw(field(st.one_of(st.floats(0, 100), st.integers(-1, 100)))),
        }
        for key in ("samples_per_s", "ended"):
            if draw(st.booleans()):
                data[key] = draw(field(st.one_of(st.none(), st.floats(0, 2e9), st.integers(0, 10), TIME_EDGES)))
    for key in (
        draw(st.lists(st.sampled_from(list(data) + ["extra"]), max_size=1)) if draw(st.integers(0, 5)) == 0 else ()
    ):
        if key in data and draw(st.booleans()):
            del data[key]
        else:
            data[key] = draw(ODD_VALUES)
    ev: dict[str, Any] = {"wseq": draw(field(st.integers(1, 1000))), "type": type_, "data": data}
    if draw(st.booleans()):
        ev["ts"] = draw(field(st.one_of(st.none(), st.floats(0, 2e9), st.integers(0, 10), TIME_EDGES)))
    if draw(st.integers(0, 30)) == 0:
        ev.pop(draw(st.sampled_from(list(ev))))
    if draw(st.integers(0, 30)) == 0:
        ev["extra"] = 1
    return ev if draw(st.integers(0, 60)) else draw(ODD_VALUES)


@st.composite
def batches(draw: st.DrawFn) -> Any:
    body: dict[str, Any] = {"attempt": draw(field(st.integers(0, 3))), "events": draw(st.lists(event(), max_size=3))}
    if draw(st.integers(0, 40)) == 0:
        body.pop(draw(st.sampled_from(list(body))))
    if draw(st.integers(0, 40)) == 0:
        body["extra"] = 1
    return body


def model_reading(raw: Any) -> tuple[int, list[tuple[str, list[tuple[str, Any]], int, float | None]]] | None:
    try:
        body = WorkerEvents.model_validate(raw)
    except Exception:  # noqa: BLE001 - any refusal
        return None
    return body.attempt, [(ev.type, list(ev.payload().items()), ev.wseq, ev.ts) for ev in body.events]


def fast_reading(raw: Any) -> tuple[int, list[tuple[str, list[tuple[str, Any]], int, float | None]]] | None:
    got = read_fast(raw)
    if got is None:
        return None
    attempt, events = got
    return attempt, [(ev.type, list(ev.data.items()), ev.wseq, ev.ts) for ev in events]


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_what_the_fast_reader_accepts_the_models_accept_the_same(raw: Any) -> None:
    fast = fast_reading(raw)
    if fast is not None:
        assert repr(fast) == repr(model_reading(raw)), "same payloads, same types (3 and 3.0 differ in the log)"
        assert all(type(ev[3]) in (float, type(None)) for ev in fast[1])


def test_the_workers_own_batches_take_the_fast_path() -> None:
    """The shapes the worker's callback and outbox send (callbacks.EventCallback, outbox.Outbox.put), including
    the ones with nothing known yet (no steps, no samples per second, a NaN loss)."""
    logs = clean_logs({"loss": 0.25, "accuracy": 1, "val_loss": math.nan})
    events = [
        {"wseq": 1, "type": "batch", "data": {"epoch": 0, "batch": 3, "steps": None, "logs": logs}, "ts": 1.7e9},
        {"wseq": 2, "type": "batch", "data": {"epoch": 0, "batch": 9, "steps": 10, "logs": {}}, "ts": 1.7e9},
        {
            "wseq": 3,
            "type": "epoch",
            "data": {"epoch": 0, "epochs": 5, "logs": logs, "seconds": 2.0, "samples_per_s": None, "ended": 1.7e9},
            "ts": 1.7e9,
        },
    ]
    raw = {"attempt": 0, "events": events}
    assert fast_reading(raw) is not None
    assert repr(fast_reading(raw)) == repr(model_reading(raw))
    assert read_fast({"attempt": 0, "events": [{"wseq": 1, "type": "log", "data": {"message": "hi"}}]}) is None
