"""Validation of a submitted job spec, so a bad job is refused before any instance is started."""

from __future__ import annotations

import re
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.errors import ValidationError
from aibro_core.requirements import check_requirements

from ..blobs import SHA_RE
from .base import ApiError

CODE_PATH_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*){0,15}\.py")
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
TRAVELLING_CALLBACKS = ("EarlyStopping", "ReduceLROnPlateau", "TerminateOnNaN")


def tree_blobs(tree: Any, where: str, dataset_ok: bool = False) -> list[str]:
    """The blob digests of a data tree: {"blob": sha, ...} | {"list": [...]} | {"dict": {...}}, or at the top of
    data.x / data.validation.x a {"dataset": sha} (a tar of tf.data's Dataset.save)."""
    if tree is None:
        return []
    if not isinstance(tree, dict):
        raise ApiError(400, f"{where} must be an object")
    if "dataset" in tree:
        if not dataset_ok:
            raise ApiError(400, f"{where} cannot be a dataset: only data.x and data.validation.x can")
        if not isinstance(tree["dataset"], str) or not SHA_RE.match(tree["dataset"]):
            raise ApiError(400, f"{where}.dataset must be a sha256 hex digest")
        return [tree["dataset"]]
    if "blob" in tree:
        if not isinstance(tree["blob"], str) or not SHA_RE.match(tree["blob"]):
            raise ApiError(400, f"{where}.blob must be a sha256 hex digest")
        return [tree["blob"]]
    if "list" in tree and isinstance(tree["list"], list):
        return [s for i, t in enumerate(tree["list"]) for s in tree_blobs(t, f"{where}[{i}]")]
    if "dict" in tree and isinstance(tree["dict"], dict):
        return [s for k, t in tree["dict"].items() for s in tree_blobs(t, f"{where}[{k!r}]")]
    raise ApiError(400, f"{where} must hold 'blob', 'list' or 'dict'")


def spec_blobs(spec: dict[str, Any]) -> list[str]:
    data = spec.get("data") or {}
    out = [spec["model"]]
    code = spec.get("code")
    if isinstance(code, dict) and isinstance(code.get("blob"), str):
        out.append(code["blob"])
    parts = [("data", data)]
    if data.get("validation") is not None:
        parts.append(("data.validation", data["validation"]))
    for where, part in parts:
        if not isinstance(part, dict):
            raise ApiError(400, f"{where} must be an object")
        for key in ("x", "y", "sample_weight"):
            out += tree_blobs(part.get(key), f"{where}.{key}", dataset_ok=key == "x")
        if isinstance(part.get("x"), dict) and "dataset" in part["x"] and (part.get("y") or part.get("sample_weight")):
            raise ApiError(400, f"{where}: a dataset yields its own targets, so y and sample_weight must be null")
    return out


def validate_spec(spec: dict[str, Any], machines: dict[str, Any]) -> dict[str, Any]:
    """Check and normalise a job spec; raise ApiError(400) naming the problem and the fix."""
    if not isinstance(spec.get("model"), str) or not SHA_RE.match(spec["model"]):
        raise ApiError(400, "'model' must be the sha256 of an uploaded .keras file")
    if not isinstance(spec.get("data"), dict) or spec["data"].get("x") is None:
        raise ApiError(400, "'data.x' is required: the training inputs")
    fit = spec.get("fit") or {}
    if not isinstance(fit, dict):
        raise ApiError(400, "'fit' must be an object of model.fit keyword arguments")
    unknown = sorted(set(fit) - set(v.FIT_KWARGS))
    if unknown:
        raise ApiError(400, f"fit arguments {unknown} cannot travel; allowed: {list(v.FIT_KWARGS)}")
    epochs = fit.get("epochs", 1)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs <= 0:
        raise ApiError(400, f"epochs must be a positive integer, got {epochs!r}")
    fit["epochs"] = epochs
    requested = spec.get("machines")
    if not isinstance(requested, list) or not requested or not all(isinstance(m, str) for m in requested):
        raise ApiError(400, "'machines' must be a non-empty list of machine ids (see GET /machines)")
    if len(requested) > 16:
        raise ApiError(400, "at most 16 machines may be listed for one job")
    unknown_m = [m for m in requested if m not in machines]
    if unknown_m:
        raise ApiError(400, f"unknown machine {unknown_m[0]!r}; available: {sorted(machines)}")
    desc = spec.get("description", "")
    if not isinstance(desc, str) or len(desc) > 500:
        raise ApiError(400, "'description' must be a string of at most 500 characters")
    cool = spec.get("cool_down_s", 0)
    if not isinstance(cool, (int, float)) or cool < 0 or cool > 7 * 24 * 3600:
        raise ApiError(400, "'cool_down_s' must be a number of seconds between 0 and one week")
    modules = spec.get("custom_modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) and MODULE_RE.match(m) for m in modules):
        raise ApiError(400, "'custom_modules' must be a list of importable module names")
    callbacks = spec.get("callbacks", [])
    if not isinstance(callbacks, list):
        raise ApiError(400, "'callbacks' must be a list")
    for cb in callbacks:
        if not isinstance(cb, dict) or cb.get("class") not in TRAVELLING_CALLBACKS:
            raise ApiError(400, f"callbacks that can travel: {list(TRAVELLING_CALLBACKS)}")
        if not isinstance(cb.get("config", {}), dict):
            raise ApiError(400, "a callback's config must be an object")
    code = _check_code(spec.get("code"))
    try:
        requirements = check_requirements(spec.get("requirements") or [], "'requirements'")
    except ValidationError as exc:
        raise ApiError(400, str(exc)) from None
    versions = spec.get("versions") or {}
    if (
        not isinstance(versions, dict)
        or len(versions) > 8
        or not all(
            isinstance(k, str) and isinstance(val, str) and len(k) <= 32 and len(val) <= 64
            for k, val in versions.items()
        )
    ):
        raise ApiError(400, "'versions' must be an object of at most 8 short strings (the kernel's versions)")
    meta = spec.get("meta") or {}
    if (
        not isinstance(meta, dict)
        or len(meta) > 8
        or not all(
            isinstance(k, str) and isinstance(val, str) and len(k) <= 64 and len(val) <= 256 for k, val in meta.items()
        )
    ):
        raise ApiError(400, "'meta' must be an object of at most 8 short strings")
    spec_blobs(spec)
    return {
        "meta": meta,
        "model": spec["model"],
        "safe_mode": bool(spec.get("safe_mode", True)),
        "custom_modules": modules,
        "code": code,
        "requirements": requirements,
        "versions": versions,
        "data": spec["data"],
        "fit": fit,
        "callbacks": callbacks,
        "machines": requested,
        "description": desc,
        "cool_down_s": float(cool),
        "wait_request_s": float(spec.get("wait_request_s", 60) or 0),
        "record": bool(spec.get("record", True)),
    }


def _check_code(code: Any) -> dict[str, Any] | None:
    """The user's own code that travels: a blob of sources (never loaded here), the modules to import, a listing."""
    if code is None:
        return None
    if not isinstance(code, dict) or not isinstance(code.get("blob"), str) or not SHA_RE.fullmatch(code["blob"]):
        raise ApiError(400, "'code' must be an object whose 'blob' is the sha256 of the uploaded code")
    modules = code.get("modules", [])
    if (
        not isinstance(modules, list)
        or len(modules) > 64
        or not all(isinstance(m, str) and len(m) <= 200 and MODULE_RE.match(m) for m in modules)
    ):
        raise ApiError(400, "'code.modules' must be a list of at most 64 importable module names")
    files = code.get("files", [])
    if not isinstance(files, list) or len(files) > 200:
        raise ApiError(400, "'code.files' must be a list of at most 200 files")
    listing = []
    for f in files:
        if (
            not isinstance(f, dict)
            or not isinstance(f.get("path"), str)
            or not CODE_PATH_RE.fullmatch(f["path"])
            or not isinstance(f.get("bytes"), int)
            or not isinstance(f.get("sha256"), str)
            or not SHA_RE.fullmatch(f["sha256"])
        ):
            raise ApiError(400, "each of 'code.files' must be {path: relative .py path, bytes: int, sha256: hex}")
        listing.append({"path": f["path"], "bytes": f["bytes"], "sha256": f["sha256"]})
    return {"blob": code["blob"], "modules": modules, "files": listing}
