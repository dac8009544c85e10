"""The backend's one JSON encoder, for its answers and for the event log it answers from (so it lives below both
the server and the storage): standard JSON only (NaN and Infinity go out as null)."""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(data: Any) -> Any:
    """The same data with every NaN/Infinity as null (an old stored row may hold one); JSON has no such numbers."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(val) for k, val in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(val) for val in data]
    return data


def _strict_encoder() -> Any:
    """json.dumps(data, allow_nan=False) builds a new encoder on every call (only all-default arguments reuse a
    cached one); under load the backend encodes thousands of small objects a second, so it keeps one."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    return make(
        None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, False
    )


_ENCODE = _strict_encoder()


def dumps(data: Any) -> str:
    """`json.dumps(data, allow_nan=False)`, with NaN and Infinity as null instead of an error."""
    try:
        if _ENCODE is not None:
            return "".join(_ENCODE(data, 0))
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False)
