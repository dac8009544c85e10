"""Validation of a submitted job spec, so a bad job is refused before any instance is started.

The spec's shape is declared once, as `models.JobSpec`; this module adds what needs the backend's state (the
machines it offers) and writes the model as the row the store keeps (`stored_spec`), which the scheduler and the
worker read.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from aibro_core.models import JobSpec, explain

from .base import ApiError


def validate_spec(spec: dict[str, Any], machines: dict[str, Any]) -> JobSpec:
    """Check a job spec; raise ApiError(400) naming the problem and the fix."""
    try:
        job = JobSpec.model_validate(spec)
    except ValidationError as exc:
        raise ApiError(400, explain(exc, "the job spec")) from None
    unknown = [m for m in job.machines if m not in machines]
    if unknown:
        raise ApiError(400, f"unknown machine {unknown[0]!r}; available: {sorted(machines)}")
    return job


def stored_spec(job: JobSpec) -> dict[str, Any]:
    """The spec as the jobs table holds it and the worker's assignment carries it: every field, defaults filled in
    (the fit's epochs, meta, requirements, versions), the user's own arguments as given."""
    return {
        "meta": job.meta or {},
        "model": job.model,
        "trial": job.trial.model_dump() if job.trial else None,
        "safe_mode": job.safe_mode,
        "custom_modules": job.custom_modules,
        "code": job.code.model_dump() if job.code else None,
        "requirements": job.requirements or [],
        "versions": job.versions or {},
        "data": job.data.model_dump(by_alias=True, exclude_unset=True),
        "fit": job.fit.model_dump(exclude_unset=True) | {"epochs": job.fit.epochs},
        "callbacks": [cb.model_dump(by_alias=True, exclude_unset=True) for cb in job.callbacks],
        "machines": job.machines,
        "description": job.description,
        "cool_down_s": float(job.cool_down_s),
        "wait_request_s": float(job.wait_request_s or 0),
        "record": job.record,
        "seed": job.seed,
        "compile": job.compile,
        "cwd": job.cwd,
        "objects": {name: ref.model_dump(exclude_none=True) for name, ref in job.objects.items()},
    }


def spec_blobs(spec: dict[str, Any]) -> list[str]:
    """The blobs a stored (validated) spec reads: the model, its code and every array or dataset of its data (and
    the notebook arrays its code reads)."""
    code = spec.get("code") or {}
    data = spec.get("data") or {}
    out = [*([spec["model"]] if spec.get("model") else []), *([code["blob"]] if code.get("blob") else [])]
    for part in (data, data.get("validation") or {}):
        for key in ("x", "y", "sample_weight"):
            out += _tree_blobs(part.get(key))
    for tree in (data.get("globals") or {}).values():
        out += _tree_blobs(tree)
    return out


def _tree_blobs(tree: Any) -> list[str]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in ("blob", "dataset"):
            if isinstance(node.get(key), str):
                out.append(node[key])
        stack.extend(reversed(node.get("list") or []))
        stack.extend(reversed(list((node.get("dict") or {}).values())))
    return out
