"""Settings read from AIBRO_* environment variables into a typed dataclass, validated by pydantic: every wrong value
is reported at once, by the variable's name, its value and the rule it breaks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class SettingsError(ValueError):
    """One or more AIBRO_* variables hold a value the setting cannot take; the message names each."""


def read_env(cls: type[T], names: Mapping[str, str], env: Mapping[str, str], **fixed: Any) -> T:
    """`cls` (a dataclass whose fields carry pydantic constraints) from the variables `names` maps its fields to;
    unset or empty variables keep the field's default, `fixed` fields are set as given."""
    raw = {field: env[var].strip() for field, var in names.items() if (env.get(var) or "").strip()}
    try:
        return TypeAdapter(cls).validate_python({**raw, **fixed})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            where = f"{names[field]}={raw[field]!r}" if field in raw else field
            problems.append(f"{where}: {err['msg'].lower()}")
        raise SettingsError(
            "; ".join(problems) + " (fix them in the backend's environment, or unset them for the defaults)"
        ) from None
