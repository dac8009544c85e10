"""Splits a %%cloud_fit cell around its one `.fit(...)` call: what runs before, the call, what runs after."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .errors import ValidationError


@dataclass
class SplitCell:
    before: list[ast.stmt]
    call: ast.Call
    target: ast.expr | None
    after: list[ast.stmt]


def _fit_calls(node: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fit"
    ]


def split_cell(source: str) -> SplitCell:
    """Find exactly one top-level `.fit(...)` statement; errors name the problem and the fix."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValidationError(f"the cell is not valid Python: {exc}") from None
    found = [(i, stmt) for i, stmt in enumerate(tree.body) if _fit_calls(stmt)]
    total = sum(len(_fit_calls(stmt)) for _, stmt in found)
    if total == 0:
        raise ValidationError(
            "no `.fit(...)` call in this %%cloud_fit cell: write e.g. `history = model.fit(x, y, epochs=5)`"
        )
    if total > 1:
        raise ValidationError(
            f"{total} `.fit(...)` calls in this %%cloud_fit cell; exactly one runs remotely: split the cell"
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
            f"line {stmt.lineno}: the `.fit(...)` call must be a statement of its own, `model.fit(...)` or "
            "`history = model.fit(...)`, not nested in another expression or block"
        )
    if _fit_calls(call.func) or any(_fit_calls(a) for a in call.args) or any(_fit_calls(k) for k in call.keywords):
        raise ValidationError("a `.fit(...)` call may not contain another `.fit(...)` call")
    return SplitCell(tree.body[:index], call, target, tree.body[index + 1 :])
