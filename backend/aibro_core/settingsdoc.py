"""The README's settings tables, written from each process's settings class (never by hand), so the documented
variables, defaults and rules are the ones the code reads: `python -m aibro_core.settingsdoc [README.md]` rewrites
them; tests/test_settings_doc.py fails while the README differs."""

from __future__ import annotations

import importlib
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .envsettings import EnvSettings

# each process's class, by name: the shared core imports neither the backend nor the notebook package
CLASSES = (
    "aibro_backend.settings:BackendSettings",
    "aibro_backend.worker.settings:WorkerSettings",  # no pydantic on a worker: a dataclass with `documented()`
    "aibro_jupyter.settings:KernelSettings",
)
MiB = 1024 * 1024
BOUNDS = ((annotated_types.Ge, "≥"), (annotated_types.Gt, ">"), (annotated_types.Le, "≤"), (annotated_types.Lt, "<"))


def settings_class(dotted: str) -> Any:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def marker(cls: type, end: bool = False) -> str:
    return f"<!-- {'/' if end else ''}settings: {cls.__name__} (python -m aibro_core.settingsdoc writes it) -->"


def table(cls: Any) -> str:
    """One row per field: its variable, default, rule and description."""
    rows = ["| Variable | Default | Rule | What it does |", "|---|---|---|---|"]
    for name, variable, default, rule, doc in documented(cls):
        rows.append(f"| `{variable}` | {_shown(name, default)} | {rule} | {doc} |")
    return "\n".join(rows)


def documented(cls: Any) -> list[tuple[str, str, Any, str, str]]:
    """(field, variable, default, rule, description) of each field: an EnvSettings class's from its pydantic fields,
    another's (the worker's) from its own `documented()`."""
    if not (isinstance(cls, type) and issubclass(cls, EnvSettings)):
        return cls.documented()
    return [
        (name, cls.variable(name), _default(field), _rule(field), field.description or "")
        for name, field in cls.model_fields.items()
    ]


def section(cls: type) -> str:
    return f"{marker(cls)}\n{table(cls)}\n{marker(cls, end=True)}"


def rewritten(readme: str) -> str:
    """`readme` with every class's table between its markers written again."""
    for dotted in CLASSES:
        cls = settings_class(dotted)
        start, end = readme.find(marker(cls)), readme.find(marker(cls, end=True))
        if start < 0 or end < start:
            raise ValueError(f"the README has no {marker(cls)} ... {marker(cls, end=True)} section")
        readme = readme[:start] + section(cls) + readme[end + len(marker(cls, end=True)) :]
    return readme


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None if field.default is PydanticUndefined else field.default


def _shown(name: str, value: Any) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, Path):
        return f"`{str(value).replace(str(Path.home()), '~', 1)}`"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and name.endswith(("_bytes", "_body")) and value >= MiB:
        return f"{value / 1024**3:g} GiB" if value >= 1024**3 else f"{value / MiB:g} MiB"
    return f"`{value}`"


def _rule(field: FieldInfo) -> str:
    kind = field.annotation
    if typing.get_origin(kind) is typing.Union or type(kind).__name__ == "UnionType":
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    metadata = list(field.metadata)
    if typing.get_origin(kind) is typing.Annotated:
        kind, *more = typing.get_args(kind)
        metadata += [m for extra in more for m in getattr(extra, "metadata", [extra])]
    if typing.get_origin(kind) is Literal:
        choices = [f"`{c}`" for c in typing.get_args(kind)]
        return ", ".join(choices[:-1]) + " or " + choices[-1]
    names = {bool: "yes or no (1/0, true/false)", int: "a whole number", float: "a number", Path: "a path"}
    rule = names.get(kind, "text")  # type: ignore[arg-type]
    bounds = [
        f"{sign} {_number(getattr(m, m.__class__.__name__.lower()))}"
        for m in metadata
        for t, sign in BOUNDS
        if isinstance(m, t)
    ]
    return rule + (" " + ", ".join(bounds) if bounds else "")


def _number(value: Any) -> str:
    if isinstance(value, int) and value >= MiB and value % MiB == 0:
        return f"{value // MiB} MiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    path = Path((argv if argv is not None else sys.argv[1:] or ["README.md"])[0])
    path.write_text(rewritten(path.read_text()))


if __name__ == "__main__":
    main()
