"""The requirements list that travels with a job: checked in the kernel, hashed the same way on the worker.

A job may name extra packages (``online_fit(..., requirements=["cowsay==6.1"])`` or
``%%cloud_fit --requirements FILE|SPEC``). The worker installs them into an environment cached per hash of the
normalised list, so the list must be normalised identically on both sides: this module is the one place that
does it.

Only named packages from the package index are accepted (PEP 508 name, extras, version specifiers, marker).
URLs, VCS links, local paths and pip options are refused: the worker cannot see the user's files, and options
such as ``--index-url`` would let one job's environment depend on something the hash does not name.

The validator is a small strict parser written here rather than ``packaging.requirements``: the core depends on
nothing beyond the standard library, numpy and requests, and ``packaging`` is only importable where some other
package happens to pull it in (pip vendors its own copy, which is not importable). The tests cross-check it
against ``packaging`` where that is installed.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable
from typing import Any

from .errors import ValidationError

MAX_REQUIREMENTS = 64
MAX_REQUIREMENT_CHARS = 200

_FIX = 'Fix: write NAME, NAME==VERSION or NAME>=X,<Y (PEP 508), for example "cowsay==6.1".'
_FIX_INDEX = (
    "Fix: name a package published on the package index instead (for your own code, put the module next to the "
    "notebook: it travels with the job)."
)
_FIX_OPTIONS = "Fix: remove the option and list only requirements, one per line, like cowsay==6.1."

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_NAME_RE = re.compile(_NAME)
# PEP 440, as packaging writes it (case-insensitive).
_VERSION = r"""
    v?
    (?:(?:[0-9]+)!)?
    [0-9]+(?:\.[0-9]+)*
    (?:[-_.]?(?:alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?:[0-9]+)?)?
    (?:(?:-[0-9]+)|(?:[-_.]?(?:post|rev|r)[-_.]?(?:[0-9]+)?))?
    (?:[-_.]?dev[-_.]?(?:[0-9]+)?)?
"""
_LOCAL = r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)"
_VERSION_RE = re.compile(rf"^{_VERSION}$", re.VERBOSE | re.IGNORECASE)
_VERSION_LOCAL_RE = re.compile(rf"^{_VERSION}{_LOCAL}?$", re.VERBOSE | re.IGNORECASE)
_PREFIX_RE = re.compile(r"^v?(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*\.\*$", re.IGNORECASE)
_CLAUSE_RE = re.compile(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*([^\s,;()]+)\s*$")
_ARCHIVE_RE = re.compile(r"\.(whl|zip|tar\.gz|tgz|tar\.bz2|tar\.xz|tar)$", re.IGNORECASE)
_OPTION_IN_LINE_RE = re.compile(r"(^|\s)--?[A-Za-z]")
_URLISH_RE = re.compile(r"^(git\+|hg\+|svn\+|bzr\+|file:|https?:|ftp:)|://|^[./~\\]|^[A-Za-z]:[\\/]", re.IGNORECASE)

_MARKER_VARS = {
    "python_version",
    "python_full_version",
    "os_name",
    "sys_platform",
    "platform_release",
    "platform_system",
    "platform_version",
    "platform_machine",
    "platform_python_implementation",
    "implementation_name",
    "implementation_version",
    "extra",
}
_MARKER_TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<lp>\()|(?P<rp>\))
        |(?P<str>'[^']*'|"[^"]*")
        |(?P<op>===|==|!=|<=|>=|~=|<|>)
        |(?P<word>[A-Za-z_][A-Za-z0-9_.]*)
    )""",
    re.VERBOSE,
)


class _Bad(Exception):
    """One entry's problem: why it is refused and how to fix it."""

    def __init__(self, why: str, fix: str = _FIX) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: `Foo_Bar.baz` and `foo-bar-baz` are one project, so they hash the same."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _check_clause(op: str, ver: str) -> str:
    if op == "===":
        return op + ver
    if ver.endswith(".*"):
        if op not in ("==", "!=") or not _PREFIX_RE.match(ver):
            raise _Bad(f"'{op}{ver}': a trailing .* is allowed only after == or != on a plain release like 1.2.*")
        return op + ver
    if op in ("==", "!="):
        ok = _VERSION_LOCAL_RE.match(ver)
    else:
        ok = _VERSION_RE.match(ver)
    if not ok:
        raise _Bad(f"'{op}{ver}' is not a valid version specifier (PEP 440 versions look like 1.2, 1.2.3, 2.0rc1)")
    release = re.match(r"^v?(?:[0-9]+!)?([0-9]+(?:\.[0-9]+)*)", ver, re.IGNORECASE)
    if op == "~=" and (not release or "." not in release.group(1)):
        raise _Bad(f"'~={ver}' needs at least two release numbers, like ~=1.2")
    return op + ver


def _check_specifiers(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    if not text.strip():
        return []
    clauses = []
    for part in text.split(","):
        m = _CLAUSE_RE.match(part)
        if not m:
            raise _Bad(
                f"'{part.strip()}' is not a version specifier (one of ==, !=, >=, <=, >, <, ~=, === and a version)"
            )
        clauses.append(_check_clause(m.group(1), m.group(2)))
    return sorted(set(clauses))


def _marker_tokens(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _MARKER_TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            raise _Bad(f"cannot read the environment marker at '{text[pos:].strip()}'")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _check_marker(text: str) -> str:
    """Validate a PEP 508 environment marker; return it with normalised spacing and quotes."""
    tokens = _marker_tokens(text)
    out: list[str] = []
    i = 0

    def peek() -> tuple[str, str]:
        return tokens[i] if i < len(tokens) else ("end", "")

    def take() -> tuple[str, str]:
        nonlocal i
        tok = peek()
        i += 1
        return tok

    def value() -> None:
        kind, tok = take()
        if kind == "str":
            body = tok[1:-1]
            out.append(f'"{body}"' if '"' not in body else f"'{body}'")
        elif kind == "word" and tok in _MARKER_VARS:
            out.append(tok)
        else:
            names = ", ".join(sorted(_MARKER_VARS))
            raise _Bad(f"'{tok or 'end of marker'}' in the marker is neither a quoted string nor one of {names}")

    def item() -> None:
        value()
        kind, tok = take()
        if kind == "op":
            out.append(tok)
        elif kind == "word" and tok == "in":
            out.append("in")
        elif kind == "word" and tok == "not" and peek() == ("word", "in"):
            take()
            out.append("not in")
        else:
            raise _Bad(f"expected a comparison (==, <, in, not in, ...) in the marker, found '{tok or 'its end'}'")
        value()

    def atom() -> None:
        if peek()[0] == "lp":
            take()
            out.append("(")
            expr()
            if take()[0] != "rp":
                raise _Bad("the marker has an unclosed '('")
            out.append(")")
        else:
            item()

    def expr() -> None:
        atom()
        while peek() in (("word", "and"), ("word", "or")):
            out.append(take()[1])
            atom()

    if not tokens:
        raise _Bad("the environment marker after ';' is empty")
    expr()
    if i != len(tokens):
        raise _Bad(f"unexpected '{tokens[i][1]}' in the environment marker")
    return " ".join(out).replace("( ", "(").replace(" )", ")")


def _check_one(entry: str) -> str:
    """Validate one requirement string; return its normalised form, or raise _Bad."""
    text = " ".join(entry.split())
    if not text:
        raise _Bad("it is empty")
    if len(text) > MAX_REQUIREMENT_CHARS:
        raise _Bad(f"it is {len(text)} characters long, more than {MAX_REQUIREMENT_CHARS}")
    if text.startswith("-"):
        raise _Bad("pip options (-r, -c, -e, --index-url, --extra-index-url, ...) are not supported", _FIX_OPTIONS)
    if _URLISH_RE.search(text) or _ARCHIVE_RE.search(text.split(";")[0].strip()):
        raise _Bad(
            "URLs, VCS links and local paths are not supported: the worker installs only named packages from the "
            "package index",
            _FIX_INDEX,
        )
    if _OPTION_IN_LINE_RE.search(text.split(";")[0]):
        raise _Bad("per-requirement pip options (--hash, --config-settings, ...) are not supported", _FIX_OPTIONS)
    if "${" in text:
        raise _Bad("environment variables are not expanded on the worker")
    m = _NAME_RE.match(text)
    if not m:
        raise _Bad("it does not start with a package name (letters, digits, '.', '-', '_')")
    name = canonical_name(m.group(0))
    rest = text[m.end() :].lstrip()
    extras: list[str] = []
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise _Bad("the extras list has no closing ']'")
        for extra in rest[1:close].split(","):
            extra = extra.strip()
            if not extra and rest[1:close].strip():
                raise _Bad("the extras list has an empty entry")
            if extra and not _NAME_RE.fullmatch(extra):
                raise _Bad(f"'{extra}' is not a valid extra name")
            if extra:
                extras.append(canonical_name(extra))
        rest = rest[close + 1 :].lstrip()
    if rest.startswith("@"):
        raise _Bad("direct references (NAME @ URL) are not supported", _FIX_INDEX)
    spec_text, semicolon, marker_text = rest.partition(";")
    if spec_text.strip() and spec_text.strip()[0] not in "<>=!~(":
        raise _Bad(f"'{spec_text.strip()}' after the name is not a version specifier")
    clauses = _check_specifiers(spec_text)
    marker = _check_marker(marker_text) if semicolon else ""
    out = name + (f"[{','.join(sorted(set(extras)))}]" if extras else "") + ",".join(clauses)
    return out + (f"; {marker}" if marker else "")


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
