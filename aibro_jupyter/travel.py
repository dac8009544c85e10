"""What travels with a job, decided in one place for every provider: the user's own code (modules next to the
notebook, local packages, classes defined in notebook cells) as source, and the packages the worker must install.

A worker shares nothing with the kernel. Code from an installed distribution or the standard library never travels
(the worker gets it from `requirements`); code that is the user's own travels as its source files, in one
content-addressed JSON blob, so the same code uploads once. Nothing is pickled."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import site
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from aibro_core.requirements import check_requirements, parse_requirements_text

from .cellcode import MAIN_MODULE, build_cell_module, is_cell_object, is_lambda, travel_name
from .errors import ValidationError

MAX_CODE_FILES = 200
MAX_CODE_BYTES = 5 * 1024 * 1024
_SKIP_DIRS = {"__pycache__", ".git", ".ipynb_checkpoints", "node_modules", ".venv", "venv", ".tox", "build", "dist"}


@dataclass
class CodePlan:
    """The code that travels: files (relative path → source) and the modules the worker imports before loading."""

    files: dict[str, str] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    roots: dict[str, str] = field(default_factory=dict)  # top-level module → the folder it came from
    installed: dict[str, str] = field(default_factory=dict)  # module → distribution the worker must have
    arrays: dict[str, Any] = field(default_factory=dict)  # notebook arrays cell definitions read: they travel as data

    def blob(self) -> bytes:
        """The deterministic JSON the worker unpacks: the same code gives the same bytes, so it uploads once."""
        return json.dumps({"files": self.files, "modules": self.modules}, sort_keys=True).encode()

    def listing(self) -> list[dict[str, Any]]:
        """What the job view shows: each file with its size and digest."""
        return [
            {"path": p, "bytes": len(src.encode()), "sha256": hashlib.sha256(src.encode()).hexdigest()}
            for p, src in sorted(self.files.items())
        ]


@lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    paths = set(site.getsitepackages()) | {site.getusersitepackages()}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            paths.add(path)
    return tuple(str(Path(p).resolve()) for p in paths if p)


OWN_PACKAGES = ("aibro_jupyter", "aibro_core", "aibro_backend")  # the worker has its own copy of the core


def _distribution_of(top: str) -> str | None:
    """The installed (non-editable) distribution that provides top-level module `top`, if any."""
    return (importlib.metadata.packages_distributions().get(top) or [None])[0]


def classify(module: str) -> tuple[str, Path | None]:
    """('builtin'|'installed'|'local', location): where a module's top-level package comes from."""
    top = module.split(".")[0]
    if top in OWN_PACKAGES:
        return "installed", None
    if top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        return "builtin", None
    mod = sys.modules.get(top)
    spec = getattr(mod, "__spec__", None) if mod is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
    if spec is None:
        return "missing", None
    locations = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec.origin not in (None, "built-in", "frozen", "namespace") else None
    path = Path(locations[0] if locations else origin) if (locations or origin) else None
    if path is None:
        return "builtin", None
    resolved = str(path.resolve())
    if resolved.startswith(_installed_roots()) or _distribution_of(top):
        return "installed", path
    return "local", path


def plan_code(objects: list[Any], namespace: dict[str, Any] | None = None) -> CodePlan:
    """The code that must travel for the model's custom `objects` (classes and functions) to rebuild remotely."""
    plan = CodePlan()
    cell_objects = [o for o in objects if is_cell_object(o)]
    pending: list[str] = []
    if cell_objects:
        cell = build_cell_module(cell_objects, namespace)
        plan.files[f"{MAIN_MODULE}.py"] = cell.source
        plan.arrays = cell.arrays
        pending += cell.imported
    named = sorted({o.__module__ for o in objects if not is_cell_object(o)})
    pending += named
    seen: set[str] = set()
    while pending:
        module = pending.pop()
        top = module.split(".")[0]
        if top in seen or top == MAIN_MODULE:
            continue
        seen.add(top)
        kind, path = classify(module)
        if kind == "installed" and top not in OWN_PACKAGES:
            plan.installed[top] = _distribution_of(top) or top
        elif kind == "local" and path is not None:
            for rel, src in _module_files(top, path).items():
                plan.files[rel] = src
                pending += _imports_of(src, rel)
            plan.roots[top] = str(path.parent if path.name != "__init__.py" else path.parent.parent)
    plan.modules = [m for m in named if classify(m)[0] == "local"]
    if cell_objects:
        plan.modules.append(MAIN_MODULE)
    _check_bounds(plan)
    return plan


def _module_files(top: str, path: Path) -> dict[str, str]:
    """A top-level module's own file, or every .py file of a local package (its modules import each other)."""
    if path.is_dir() or path.name == "__init__.py":
        root = path if path.is_dir() else path.parent
        files = {}
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root.parent)
            if _SKIP_DIRS & set(rel.parts):
                continue
            files[rel.as_posix()] = _read_source(f)
            if len(files) > MAX_CODE_FILES:
                break
        return files
    if path.suffix != ".py":
        raise ValidationError(
            f"module {top} ({path}) is compiled ({path.suffix}), so its source cannot travel: "
            "install it on the worker with requirements=[...] instead"
        )
    return {path.name: _read_source(path)}


def _read_source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read {path} as UTF-8 Python source to send with the job: {exc}") from None


def _imports_of(source: str, rel: str) -> list[str]:
    """Top-level modules a travelling file imports (relative imports stay inside its package, which travels)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValidationError(f"{rel} has a syntax error ({exc}): fix it before sending it with a job") from None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def _check_bounds(plan: CodePlan) -> None:
    size = sum(len(s.encode()) for s in plan.files.values())
    if len(plan.files) > MAX_CODE_FILES or size > MAX_CODE_BYTES:
        big = ", ".join(sorted(plan.roots.values())[:3])
        raise ValidationError(
            f"the code that would travel with this job is {len(plan.files)} files / {size} bytes (limit "
            f"{MAX_CODE_FILES} files / {MAX_CODE_BYTES} bytes), from {big}: keep custom layers in a small module "
            "next to the notebook, or install your package on the worker with requirements=[...]"
        )


def warn_missing_requirements(plan: CodePlan, requirements: list[str]) -> None:
    """Custom objects from installed packages need those packages on the worker: say so unless they are listed."""
    listed = {_project(r) for r in requirements}
    missing = {}
    for top, dist in plan.installed.items():
        if top in ("keras", "tensorflow", "numpy") or _project(dist) in listed:
            continue
        try:
            missing[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing[dist] = ""
    if missing:
        pins = ", ".join(f"'{d}=={ver}'" if ver else f"'{d}'" for d, ver in sorted(missing.items()))
        warnings.warn(
            f"the model uses code from installed packages ({', '.join(sorted(missing))}); that code does not travel, "
            f"so the worker needs them installed: pass requirements=[{pins}] (or %%cloud_fit --requirements)",
            stacklevel=4,
        )


def _project(spec: str) -> str:
    name = spec.strip()
    for sep in "<>=!~;[ @":
        name = name.split(sep)[0]
    return name.lower().replace("_", "-").replace(".", "-")


def requirements_from(value: Any, argname: str = "requirements") -> list[str]:
    """The packages the worker installs: a list of specs, or (from %%cloud_fit --requirements) a requirements
    file's path or specs separated by commas or spaces. Checked here, before anything is uploaded."""
    if isinstance(value, (str, Path)):
        text = str(value).strip()
        path = Path(text).expanduser()
        if text and (path.is_file() or text.endswith(".txt")):
            try:
                return parse_requirements_text(path.read_text(), str(path))
            except OSError as exc:
                raise ValidationError(f"{argname}: cannot read the requirements file {path} ({exc})") from None
        value = [part for part in text.replace(",", " ").split() if part]
    return check_requirements(value, argname)


def build_name(fn: Any) -> str:
    """`module:function` of a search's build function as the worker imports it from the travelling code."""
    if not callable(fn) or getattr(fn, "__qualname__", None) != getattr(fn, "__name__", None) or is_lambda(fn):
        raise ValidationError(
            f"the search's build function must be a plain function defined at the top of a cell or module, not "
            f"{fn!r}: def build_model(hp): ... and pass it to the tuner"
        )
    module = MAIN_MODULE if is_cell_object(fn) else str(fn.__module__)
    return f"{module}:{travel_name(fn)}"
