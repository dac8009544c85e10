"""The requirements list that travels with a job: checked in the kernel, hashed the same way on the worker.

A job may name extra packages (``online_fit(..., requirements=["cowsay==6.1"])`` or
``%%cloud_fit --requirements FILE|SPEC``). The worker installs them into an environment cached per hash of the
normalised list, so the list must be normalised identically on both sides: this module is the one place that
does it.

Only named packages from the package index are accepted: a name, extras, version specifiers whose versions are
versions (``packaging`` parses them; ``===``, which compares text, is refused) and a marker. URLs, VCS links, local
paths, archive names and pip options are refused: the worker cannot see the user's files, and options such as
``--index-url`` would let one job's environment depend on something the hash does not name.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .errors import ValidationError

MAX_REQUIREMENTS = 64
MAX_REQUIREMENT_CHARS = 200

_FIX = 'Fix: write NAME, NAME==VERSION or NAME>=X,<Y (PEP 508), for example "cowsay==6.1".'
_FIX_INDEX = (
    "Fix: name a package published on the package index instead (for your own code, put the module next to the "
    "notebook: it travels with the job)."
)
_FIX_OPTIONS = "Fix: remove the option and list only requirements, one per line, like cowsay==6.1."

_ARCHIVE_RE = re.compile(r"\.(whl|zip|tar\.gz|tgz|tar\.bz2|tar\.xz|tar|egg)(?![A-Za-z0-9])", re.IGNORECASE)
_OPTION_IN_LINE_RE = re.compile(r"(^|\s)--?[A-Za-z]")
_URLISH_RE = re.compile(r"^(git\+|hg\+|svn\+|bzr\+|file:|https?:|ftp:)|://|^[./~\\]|^[A-Za-z]:[\\/]", re.IGNORECASE)


class _Bad(Exception):
    """One entry's problem: why it is refused and how to fix it."""

    def __init__(self, why: str, fix: str = _FIX) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: `Foo_Bar.baz` and `foo-bar-baz` are one project, so they hash the same."""
    return canonicalize_name(name)


def _check_clause(op: str, ver: str) -> str:
    if op == "===":
        raise _Bad(f"'==={ver}' compares text, not versions (pip would take a file name there): use =={ver}")
    if ver.endswith(".*"):
        if op not in ("==", "!="):
            raise _Bad(f"'{op}{ver}': a trailing .* is allowed only after == or != on a plain release like 1.2.*")
        ver = ver[:-2]
    try:
        Version(ver)
    except InvalidVersion:
        raise _Bad(f"'{op}{ver}' is not a version (PEP 440 versions look like 1.2, 1.2.3, 2.0rc1)") from None
    return ver


def _explain(head: str, parser: str) -> str:
    """What is wrong with the part before the marker, in words about versions where packaging's parser only says
    what token it expected."""
    name = re.match(r"\s*[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?(\[[^\]]*\])?", head)
    rest = head[name.end() :].strip() if name else ""
    if name and rest and not rest.startswith(("(", "@", "[")):
        for clause in rest.split(","):
            m = re.match(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*(\S+)\s*$", clause)
            if not m:
                return f"'{clause.strip()}' after the name is not a version specifier (==, !=, >=, <=, >, <, ~=)"
            _check_clause(m.group(1), m.group(2))
            if m.group(1) == "~=" and "." not in m.group(2):
                return f"'~={m.group(2)}' needs at least two release numbers, like ~=1.2"
    return parser


def _check_one(entry: str) -> str:
    """Validate one requirement string; return its normalised form, or raise _Bad."""
    text = " ".join(entry.split())
    if not text:
        raise _Bad("it is empty")
    if len(text) > MAX_REQUIREMENT_CHARS:
        raise _Bad(f"it is {len(text)} characters long, more than {MAX_REQUIREMENT_CHARS}")
    if text.startswith("-"):
        raise _Bad("pip options (-r, -c, -e, --index-url, --extra-index-url, ...) are not supported", _FIX_OPTIONS)
    head = text.split(";")[0]
    if _URLISH_RE.search(text) or _ARCHIVE_RE.search(head) or "/" in head or "\\" in head:
        raise _Bad(
            "URLs, VCS links, local paths and archive names are not supported: the worker installs only named "
            "packages from the package index",
            _FIX_INDEX,
        )
    if _OPTION_IN_LINE_RE.search(head):
        raise _Bad("per-requirement pip options (--hash, --config-settings, ...) are not supported", _FIX_OPTIONS)
    if "${" in text:
        raise _Bad("environment variables are not expanded on the worker")
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise _Bad(_explain(head, str(exc).splitlines()[0])) from None
    if req.url:
        raise _Bad("direct references (NAME @ URL) are not supported", _FIX_INDEX)
    for spec in req.specifier:
        _check_clause(spec.operator, spec.version)
        if spec.operator == "~=" and "." not in spec.version.split("+")[0]:
            raise _Bad(f"'~={spec.version}' needs at least two release numbers, like ~=1.2")
    extras = sorted({canonicalize_name(e) for e in req.extras})
    clauses = sorted({str(spec) for spec in req.specifier})
    out = canonicalize_name(req.name) + (f"[{','.join(extras)}]" if extras else "") + ",".join(clauses)
    return out + (f"; {req.marker}" if req.marker else "")


def _finish(found: Iterable[str]) -> list[str]:
    return sorted(set(found))


def check_requirements(value: Any, argname: str = "requirements") -> list[str]:
    """Validate a job's requirements list in the kernel, before anything is uploaded.

    Returns the normalised, de-duplicated, sorted list the worker installs and hashes (None gives []).
    Raises ValidationError naming the bad entry, `argname` and the fix.
    """
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        got = f"the string {value!r}" if isinstance(value, str) else f"a {type(value).__name__}"
        raise ValidationError(
            f"{argname} must be a list of requirement strings, got {got}. Fix: pass a list such as "
            f'{argname}=["cowsay==6.1"] (for a requirements file use %%cloud_fit --requirements FILE).'
        )
    if len(value) > MAX_REQUIREMENTS:
        raise ValidationError(
            f"{argname} has {len(value)} entries, more than {MAX_REQUIREMENTS}. Fix: list only the packages the "
            "training code imports that the worker lacks (their dependencies are installed with them)."
        )
    found = []
    for i, entry in enumerate(value):
        if not isinstance(entry, str):
            raise ValidationError(
                f"{argname}[{i}] is a {type(entry).__name__}, not a string. Fix: give each requirement as a "
                'string such as "cowsay==6.1".'
            )
        try:
            found.append(_check_one(entry))
        except _Bad as bad:
            raise ValidationError(
                f"{argname}[{i}] = {entry!r} is not a valid requirement: {bad.why}. {bad.fix}"
            ) from None
    return _finish(found)


def parse_requirements_text(text: str, source: str = "requirements file") -> list[str]:
    """Read requirements-file text (comments, blank lines, backslash continuations) into a checked list.

    The client reads the file; this only parses it, so the kernel and tests share one reading. Options lines
    (-r, -e, --index-url, ...), URLs, VCS links and local paths are refused with the line number and the reason.
    """
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for n, raw in enumerate(text.splitlines(), start=1):
        if not pending:
            start = n
        if raw.endswith("\\") and not re.match(r"^\s*#", raw):
            pending += raw[:-1]
            continue
        line = re.sub(r"(^|\s)#.*$", "", pending + raw).strip()
        pending = ""
        if line:
            logical.append((start, line))
    if pending.strip():
        logical.append((start, re.sub(r"(^|\s)#.*$", "", pending).strip()))
    if len(logical) > MAX_REQUIREMENTS:
        raise ValidationError(
            f"{source} has {len(logical)} requirements, more than {MAX_REQUIREMENTS}. Fix: list only the packages "
            "the training code imports that the worker lacks (their dependencies are installed with them)."
        )
    found = []
    for n, line in logical:
        try:
            found.append(_check_one(line))
        except _Bad as bad:
            raise ValidationError(
                f"{source} line {n}: {line!r} is not a valid requirement: {bad.why}. {bad.fix}"
            ) from None
    return _finish(found)


def python_tag(version: tuple[int, ...] | None = None) -> str:
    """'3.11' for the running interpreter: an environment is valid for one interpreter major.minor only."""
    v = version or tuple(sys.version_info[:2])
    return f"{v[0]}.{v[1]}"


def requirements_hash(requirements: Any, python: str | None = None) -> str:
    """sha256 hex of the normalised list and the Python major.minor: the key of a cached worker environment.

    The same packages in any order or case give the same hash. `python` defaults to the running interpreter's
    major.minor; pass the worker's when hashing elsewhere.
    """
    reqs = check_requirements(list(requirements))
    body = f"python {python or python_tag()}\n" + "\n".join(reqs)
    return hashlib.sha256(body.encode()).hexdigest()


def runtime_versions() -> dict[str, str]:
    """This process's Python, TensorFlow and Keras versions (the latter two imported lazily, omitted if absent)."""
    import importlib
    import platform

    found = {"python": platform.python_version()}
    for name in ("tensorflow", "keras"):
        try:
            mod = sys.modules.get(name) or importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent or broken: nothing to compare
            continue
        ver = getattr(mod, "__version__", None)
        if isinstance(ver, str):
            found[name] = ver
    return found


def _major_minor(version: Any) -> tuple[int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_mismatch(kernel: dict, worker: dict) -> str | None:
    """A warning when the kernel's and the worker's TensorFlow or Keras differ in major.minor, else None.

    A model saved by one Keras may load or train differently in another, so the user should know before
    trusting the result. Missing or unreadable versions are not a mismatch.
    """
    problems = []
    for key, label in (("tensorflow", "TensorFlow"), ("keras", "Keras")):
        k, w = _major_minor(kernel.get(key)), _major_minor(worker.get(key))
        if k and w and k != w:
            problems.append(f"{label} {kernel[key]} in the kernel but {worker[key]} on the worker")
    if not problems:
        return None
    return (
        "Version mismatch: "
        + "; ".join(problems)
        + ". The model may load or train differently on the worker. Fix: install matching versions in the kernel "
        "(or on the worker host) so the major.minor versions agree."
    )
