"""Splits a %%cloud_fit cell around its one `.fit(...)` call (a %%cloud_tune cell around its `.search(...)`): what
runs before, the call, what runs after."""

from __future__ import annotations

import ast
import hashlib
import linecache
from dataclasses import dataclass

from .errors import ValidationError


@dataclass
class SplitCell:
    before: list[ast.stmt]
    call: ast.Call
    target: ast.expr | None
    after: list[ast.stmt]
    filename: str = "<cloud_fit>"  # what its statements are compiled as: its source is there for linecache


def remembered(source: str) -> str:
    """A file name for the cell's source that linecache (and so inspect) answers for, as IPython does for its own
    cells: a class or function the cell defines before its fit travels as that source."""
    filename = f"<cloud-cell-{hashlib.sha256(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return filename


def _calls(node: ast.AST, method: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method
    ]


def split_cell(source: str, method: str = "fit", magic: str = "%%cloud_fit") -> SplitCell:
    """Find exactly one top-level `.METHOD(...)` statement; errors name the problem and the fix."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValidationError(f"the cell is not valid Python: {exc}") from None
    found = [(i, stmt) for i, stmt in enumerate(tree.body) if _calls(stmt, method)]
    total = sum(len(_calls(stmt, method)) for _, stmt in found)
    example = "history = model.fit(x, y, epochs=5)" if method == "fit" else f"tuner.{method}(x, y, epochs=5)"
    if total == 0:
        raise ValidationError(f"no `.{method}(...)` call in this {magic} cell: write e.g. `{example}`")
    if total > 1:
        raise ValidationError(
            f"{total} `.{method}(...)` calls in this {magic} cell; exactly one runs remotely: split the cell"
        )
    index, stmt = found[0]
    target: ast.expr | None = None
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Call):
        call, target = stmt.value, stmt.targets[0]
    elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Call):
        call, target = stmt.value, stmt.target
    else:
        raise ValidationError(
            f"line {stmt.lineno}: the `.{method}(...)` call must be a statement of its own, `{example}`, not nested "
            "in another expression or block"
        )
    inner = _calls(call.func, method) + [c for a in (*call.args, *call.keywords) for c in _calls(a, method)]
    if inner:
        raise ValidationError(f"a `.{method}(...)` call may not contain another `.{method}(...)` call")
    return SplitCell(tree.body[:index], call, target, tree.body[index + 1 :], remembered(source))
