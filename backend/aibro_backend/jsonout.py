"""The backend's one JSON encoder for answers: standard JSON only (NaN and Infinity go out as null)."""

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


def dumps(data: Any) -> str:
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False)
