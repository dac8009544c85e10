"""Validation of a submitted job spec, so a bad job is refused before any instance is started.

The spec's shape is declared once, as `models.JobSpec`; this module adds what needs the backend's state (the
machines it offers). The store keeps the model (storage/records.py) and the scheduler and the worker read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from aibro_core.models import JobSpec, explain

from ..storage.records import job_spec_text
from .base import ApiError

GANG_PROVIDERS = ("local",)
"""Whose machines run a job of several workers today: the local one, as processes sharing its cores."""


def validate_spec(spec: dict[str, Any] | JobSpec, machines: Mapping[str, tuple[str, object]]) -> JobSpec:
    """Check a job spec (as it came, or one the backend derived from a stored one: a replay, a study's trial, whose
    changed fields are checked again as the row that keeps it will be read); raise ApiError(400) naming the problem
    and the fix."""
    try:
        job = (
            JobSpec.model_validate_json(job_spec_text(spec))
            if isinstance(spec, JobSpec)
            else JobSpec.model_validate(spec)
        )
    except ValidationError as exc:
        raise ApiError(400, explain(exc, "the job spec")) from None
    unknown = [m for m in job.machines if m not in machines]
    if unknown:
        raise ApiError(400, f"unknown machine {unknown[0]!r}; available: {sorted(machines)}")
    if job.workers > 1:
        elsewhere = [m for m in job.machines if machines[m][0] not in GANG_PROVIDERS]
        if elsewhere:
            raise ApiError(
                400,
                f"a job of {job.workers} workers runs on this backend's own machines only for now "
                f"({', '.join(m for m in machines if machines[m][0] in GANG_PROVIDERS) or 'none here'}); "
                f"{elsewhere[0]!r} is not one: pick a local machine, or submit with workers 1",
            )
    return job
