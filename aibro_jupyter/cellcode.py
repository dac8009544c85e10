"""Classes and functions defined in notebook cells (`__main__`) → the source of one module that defines them again.

A worker cannot import `__main__` from the kernel, and nothing may be pickled, so what a model names from a cell
travels as source: each definition as the user wrote it, the imports and simple constants it reads, and the other
cell definitions it depends on, in dependency order. Anything else it reads from the notebook (an array, a model)
is refused here with the name and the fix, instead of a NameError on the worker."""

from __future__ import annotations

import ast
import builtins
import cmath
import hashlib
import inspect
import linecache
import symtable
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ValidationError

MAIN_MODULE = "__aibro_main__"
GLOBALS_MODULE = "__aibro_globals__"  # the notebook arrays the definitions read, loaded on the worker as data
_LITERALS = (type(None), bool, int, float, complex, str, bytes)


@dataclass
class CellCode:
    """The module that re-creates the cell definitions, and the modules its imports name (to check they travel)."""

    source: str = ""
    imported: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    arrays: dict[str, Any] = field(default_factory=dict)  # notebook arrays the definitions read, by name


def is_cell_object(obj: Any) -> bool:
    return getattr(obj, "__module__", None) == "__main__"


def is_lambda(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType) and obj.__name__ == "<lambda>"


def travel_name(obj: Any, namespace: dict[str, Any] | None = None) -> str:
    """The name a cell definition has in the travelling module: its own, or for a lambda the notebook variable
    that holds it (`schedule = lambda epoch, lr: ...`), else a name made from its source."""
    if not is_lambda(obj):
        return str(obj.__name__)
    ns = namespace if namespace is not None else vars(sys.modules["__main__"])
    held = sorted(k for k, val in ns.items() if val is obj and k.isidentifier() and not k.startswith("_"))
    if held:
        return held[0]
    digest = hashlib.sha256(lambda_source(obj).encode()).hexdigest()[:10]
    return f"_lambda_{digest}"


def lambda_source(obj: Any) -> str:
    """The text of a lambda as written in its cell (`lambda epoch, lr: lr * 0.9`), found by its line and its
    argument names; refused when two lambdas on that line take the same arguments."""
    code = obj.__code__
    params = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    text = "".join(linecache.getlines(code.co_filename))
    found: list[str] = []
    try:
        tree = ast.parse(text) if text else None
    except SyntaxError:
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno:
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            if names == params:
                found.append(ast.get_source_segment(text, node) or ast.unparse(node))
    if len(found) != 1:
        where = "two lambdas with the same arguments on one line" if found else "no source for it"
        raise ValidationError(
            f"a lambda taking ({', '.join(params)}) defined in the notebook cannot travel ({where}): define it with "
            "`def name(...):` in a cell instead"
        )
    return found[0]


def definition_source(obj: Any) -> str:
    """The source of a class or function defined in a notebook cell (or a script run as __main__)."""
    if is_lambda(obj):
        return f"{travel_name(obj)} = {lambda_source(obj)}"
    name = obj.__name__
    for filename, lineno in _code_locations(obj):
        node = _find_def(linecache.getlines(filename), name, lineno)
        if node is not None:
            return node
    for cell in reversed(_ipython_cells()):
        node = _find_def(cell.splitlines(keepends=True), name, None)
        if node is not None:
            return node
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        raise ValidationError(
            f"cannot find the source of {name}, defined in __main__: define it in a notebook cell or a script "
            "that is saved, or move it into a module next to the notebook"
        ) from None


def _code_locations(obj: Any) -> list[tuple[str, int]]:
    if isinstance(obj, types.FunctionType):
        return [(obj.__code__.co_filename, obj.__code__.co_firstlineno)]
    found = []
    for val in vars(obj).values():
        func = getattr(val, "__func__", val)
        if isinstance(val, property):
            func = val.fget
        if isinstance(func, types.FunctionType) and func.__qualname__.startswith(obj.__qualname__ + "."):
            found.append((func.__code__.co_filename, func.__code__.co_firstlineno))
    return found


def _find_def(lines: list[str], name: str, lineno: int | None) -> str | None:
    """The top-level def/class `name` in `lines` (the one spanning `lineno` when given), decorators included."""
    if not lines:
        return None
    text = "".join(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != name:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if lineno is None or first <= lineno <= (node.end_lineno or node.lineno):
            return "".join(lines[first - 1 : node.end_lineno])
    return None


def _ipython_cells() -> list[str]:
    try:
        from IPython import get_ipython
    except ImportError:
        return []
    shell = get_ipython()
    if shell is None:
        return []
    return [c for c in shell.history_manager.input_hist_parsed if c]


def _global_names(source: str) -> set[str]:
    """Names the definition reads from its module's globals (symtable knows what is local, free or global)."""
    table = symtable.symtable(source, "<cell>", "exec")
    names: set[str] = set()
    top_assigned = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}

    def walk(t: symtable.SymbolTable, top: bool) -> None:
        for sym in t.get_symbols():
            if top:
                if sym.is_referenced() and sym.get_name() not in top_assigned:
                    names.add(sym.get_name())
            elif sym.is_global() and sym.is_referenced() and sym.get_name() not in top_assigned:
                names.add(sym.get_name())
        for child in t.get_children():
            walk(child, False)

    walk(table, True)
    return names


def build_cell_module(objects: list[Any], namespace: dict[str, Any] | None = None) -> CellCode:
    """Source of a module defining `objects` (cell classes/functions) and everything from the notebook they read."""
    ns = namespace if namespace is not None else vars(sys.modules["__main__"])
    imports: dict[str, str] = {}
    consts: dict[str, str] = {}
    aliases: dict[str, str] = {}
    defs: list[tuple[str, str]] = []
    done: set[str] = set()
    imported: list[str] = []
    arrays: dict[str, Any] = {}

    def add(obj: Any, stack: tuple[str, ...]) -> None:
        name = travel_name(obj, ns)
        if name in done or name in stack:
            return
        src = f"{name} = {lambda_source(obj)}" if is_lambda(obj) else _dedent(definition_source(obj))
        for g in sorted(_global_names(src)):
            if g == name:
                continue
            if g not in ns:
                if hasattr(builtins, g):
                    continue
                raise ValidationError(
                    f"{name}, defined in a notebook cell, reads the name `{g}`, which the notebook does not define "
                    "(yet): define it before the model is built, or import it inside the class"
                )
            _dependency(name, g, ns[g], stack + (name,))
        done.add(name)
        defs.append((name, src))

    def _dependency(owner: str, g: str, val: Any, stack: tuple[str, ...]) -> None:
        if isinstance(val, types.ModuleType):
            imports[g] = f"import {val.__name__}" if g == val.__name__ else f"import {val.__name__} as {g}"
            imported.append(val.__name__)
        elif isinstance(val, (type, types.FunctionType)) and is_cell_object(val):
            add(val, stack)
            if travel_name(val, ns) != g:
                aliases[g] = f"{g} = {travel_name(val, ns)}"
        elif isinstance(val, (type, types.FunctionType, types.BuiltinFunctionType)):
            module, qual = getattr(val, "__module__", None), getattr(val, "__qualname__", "")
            if not module or "<" in qual or "." in qual:
                raise ValidationError(
                    f"{owner}, defined in a notebook cell, uses `{g}` ({qual or val!r}), which cannot be imported "
                    "by name on the worker: move it to module level in a .py file next to the notebook"
                )
            imports[g] = f"from {module} import {qual}" + (f" as {g}" if g != qual else "")
            imported.append(module)
        elif _is_literal(val):
            consts[g] = f"{g} = {val!r}"
        elif isinstance(val, np.generic) and _is_literal(val.item()):
            consts[g] = f"{g} = {val.item()!r}"
        elif isinstance(val, np.ndarray):
            imports[g] = f"from {GLOBALS_MODULE} import {g}"  # travels as data, as the fit's arrays do
            arrays[g] = val
        else:
            raise ValidationError(
                f"{owner}, defined in a notebook cell, reads the notebook variable `{g}` "
                f"({type(val).__module__}.{type(val).__name__}), which cannot travel (as source, or as a numpy "
                "array does, as data): pass it to the constructor (and return it from get_config), make it a numpy "
                "array, or create it inside the class"
            )

    for obj in objects:
        add(obj, ())
    body = ['"""Definitions from notebook cells, re-created on the worker by aibro."""']
    body += sorted(set(imports.values())) + [consts[k] for k in sorted(consts)]
    body += [src for _, src in defs] + [aliases[k] for k in sorted(aliases)]
    return CellCode("\n\n".join(body) + "\n", sorted(set(imported)), [n for n, _ in defs], arrays)


def _is_literal(val: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(val, (float, complex)):
        return cmath.isfinite(val)
    if isinstance(val, _LITERALS):
        return len(val) <= 10_000 if isinstance(val, (str, bytes)) else True
    if isinstance(val, (tuple, list, frozenset, set)) and len(val) <= 1000:
        return all(_is_literal(v, depth + 1) for v in val)
    if isinstance(val, dict) and len(val) <= 1000:
        return all(_is_literal(k, depth + 1) and _is_literal(v, depth + 1) for k, v in val.items())
    return False


def _dedent(src: str) -> str:
    import textwrap

    return textwrap.dedent(src)
