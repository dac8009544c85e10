"""The job spec's bounds are defined once (aibro_core/bounds.py): the kernel's checks refuse exactly past them, naming
the argument the user typed, and the backend's document states the same numbers."""

from __future__ import annotations

import pytest

from aibro_core import bounds
from aibro_core.models import JobSpec
from aibro_jupyter.checks import check_job_args, fit_batch_size
from aibro_jupyter.errors import ValidationError
from aibro_jupyter.fitrequest import FitRequest

pytestmark = pytest.mark.fast


def _args(**over: object) -> FitRequest:
    return FitRequest(None, None, **{"machine_ids": "local-cpu", **over})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "most"),
    [
        ("cool_down_period_s", bounds.MAX_COOL_DOWN_S),
        ("wait_request_s", bounds.MAX_WAIT_REQUEST_S),
        ("description", bounds.MAX_DESCRIPTION_CHARS),
    ],
)
def test_the_kernel_refuses_just_past_each_bound(name: str, most: int) -> None:
    at, past = ("x" * most, "x" * (most + 1)) if name == "description" else (most, most + 1)
    check_job_args(_args(**{name: at}))
    with pytest.raises(ValidationError, match=name):
        check_job_args(_args(**{name: past}))


def test_the_backends_document_says_the_same_numbers() -> None:
    schema = JobSpec.model_json_schema()
    props = schema["properties"]

    def most(prop: dict) -> float | None:
        for option in prop.get("anyOf", [prop]):
            if "maximum" in option or "maxLength" in option:
                return option.get("maximum", option.get("maxLength"))
        return None

    assert most(props["cool_down_s"]) == bounds.MAX_COOL_DOWN_S
    assert most(props["wait_request_s"]) == bounds.MAX_WAIT_REQUEST_S
    assert most(props["description"]) == bounds.MAX_DESCRIPTION_CHARS
    fit = schema["$defs"]["FitArgs"]["properties"]
    assert most(fit["batch_size"]) == bounds.MAX_BATCH_SIZE and most(fit["epochs"]) == bounds.MAX_EPOCHS
    assert fit_batch_size(bounds.MAX_BATCH_SIZE, "batch_size", None) == bounds.MAX_BATCH_SIZE
