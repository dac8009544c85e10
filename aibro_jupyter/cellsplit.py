"""Splits a %%cloud_fit cell around its one `.fit(...)` call (a %%cloud_tune cell around its `.search(...)`): what
runs before, the call, what runs after. A fit that is no statement of its own (in a loop, an if, a with, a try, or
inside an expression) is not split: the whole cell is rewritten to await a helper where its fit was
(`rewrite_fit`)."""

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


@dataclass
class FitInBlock:
    """A %%cloud_fit cell whose one fit runs as often as the cell's own code reaches it (a for/while loop, an if, a
    with, a try, an expression): the whole cell, with that call replaced by `await HELPER(receiver, *args,
    **kwargs)`, compiled so that the cell's top level may await (the flag IPython's autoawait uses)."""

    code: object  # the compiled cell: evaluated in the notebook's namespace, it gives the coroutine that runs it
    receiver: str  # the receiver's source, `model` in `model.fit(...)`, for messages
    line: int  # the fit call's line in the cell
    last: str | None  # the name that receives the value of the cell's final expression, if it ends with one
    looped: bool  # whether the fit is in a loop's body (it may run many times), not just in a block
    filename: str = "<cloud_fit>"


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


def _example(method: str) -> str:
    return "history = model.fit(x, y, epochs=5)" if method == "fit" else f"tuner.{method}(x, y, epochs=5)"


def _one_call(source: str, method: str, magic: str) -> tuple[ast.Module, int, ast.stmt]:
    """The parsed cell, and the index of its top-level statement that holds its one `.METHOD(...)` call."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValidationError(f"the cell is not valid Python: {exc}") from None
    found = [(i, stmt) for i, stmt in enumerate(tree.body) if _calls(stmt, method)]
    total = sum(len(_calls(stmt, method)) for _, stmt in found)
    if total == 0:
        raise ValidationError(f"no `.{method}(...)` call in this {magic} cell: write e.g. `{_example(method)}`")
    if total > 1:
        raise ValidationError(
            f"{total} `.{method}(...)` calls in this {magic} cell; exactly one runs remotely: split the cell"
        )
    return tree, found[0][0], found[0][1]


def _split(tree: ast.Module, index: int, stmt: ast.stmt, method: str, source: str) -> SplitCell | None:
    """The cell around its call when the call is a statement of its own (`h = m.fit(...)`, `m.fit(...)`), else
    None."""
    target: ast.expr | None = None
    if isinstance(stmt, ast.Expr):
        call = stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        call, target = stmt.value, stmt.targets[0]
    elif isinstance(stmt, ast.AnnAssign):
        call, target = stmt.value, stmt.target
    else:
        return None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == method):
        return None
    return SplitCell(tree.body[:index], call, target, tree.body[index + 1 :], remembered(source))


def split_cell(source: str, method: str = "fit", magic: str = "%%cloud_fit") -> SplitCell:
    """Find exactly one top-level `.METHOD(...)` statement; errors name the problem and the fix."""
    tree, index, stmt = _one_call(source, method, magic)
    split = _split(tree, index, stmt, method, source)
    if split is None:
        raise ValidationError(
            f"line {stmt.lineno}: the `.{method}(...)` call must be a statement of its own, `{_example(method)}`, not "
            "nested in another expression or block"
        )
    return split


def fit_cell(source: str, helper: str) -> SplitCell | FitInBlock:
    """A %%cloud_fit cell as it will run: split around a top-level fit statement (the common case, run as it always
    was: the statements before, the panel, the statements after), else rewritten to await `helper` wherever its fit
    is (see `rewrite_fit`)."""
    tree, index, stmt = _one_call(source, "fit", "%%cloud_fit")
    return _split(tree, index, stmt, "fit", source) or rewrite_fit(tree, helper, source)


_DEFERRED = {
    ast.FunctionDef: "def",
    ast.AsyncFunctionDef: "async def",
    ast.ClassDef: "class",
    ast.Lambda: "lambda",
    ast.GeneratorExp: "generator expression",
}


def _where(tree: ast.Module, call: ast.Call) -> list[ast.AST]:
    """The nodes from the cell down to `call`, outermost first."""
    path: list[ast.AST] = []

    def down(node: ast.AST) -> bool:
        path.append(node)
        if node is call or any(down(child) for child in ast.iter_child_nodes(node)):
            return True
        path.pop()
        return False

    down(tree)
    return path


def _in_a_loop(path: list[ast.AST]) -> bool:
    """Whether the call at the end of `path` runs again and again: in a for loop's body, a while loop, or a
    comprehension (past its first iterable, which is evaluated once)."""
    for node, inner in zip(path, path[1:]):
        if isinstance(node, ast.While) or (isinstance(node, ast.For) and inner in node.body):
            return True
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp)):
            first = node.generators[0]
            if not (inner is first and path[path.index(inner) + 1] is first.iter):
                return True
    return False


def _own_await(tree: ast.Module) -> ast.AST | None:
    """An await of the cell's own at its top level (not inside a function it defines), if any."""

    def find(node: ast.AST) -> ast.AST | None:
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)) or (
            isinstance(node, ast.comprehension) and node.is_async
        ):
            return node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return None
        return next((f for child in ast.iter_child_nodes(node) if (f := find(child)) is not None), None)

    return find(tree)


def rewrite_fit(tree: ast.Module, helper: str, source: str) -> FitInBlock:
    """The cell, its fit call replaced by `await helper(receiver, *args, **kwargs)`.

    Why an await, not a blocking call: a loop cannot await unless the cell itself is a coroutine, and only a cell
    that waits on the kernel's loop keeps the panel's Cancel and Detach working (cellwait.py); compiled with
    PyCF_ALLOW_TOP_LEVEL_AWAIT, as IPython's autoawait compiles a cell, the whole cell is that coroutine, run in the
    notebook's namespace with its own statements unchanged. The receiver and the arguments are evaluated by Python
    where the call was, in the order a method call evaluates them, on every pass.

    Refused: a fit inside a function, lambda, class body or generator expression the cell defines (it runs only when
    that is called or iterated, maybe after the cell, where nothing could await it), and a cell that awaits
    something of its own (it would wait on another loop than the one these awaits are driven by)."""
    call = _calls(tree, "fit")[0]
    assert isinstance(call.func, ast.Attribute)
    receiver = ast.unparse(call.func.value)
    path = _where(tree, call)
    looped = _in_a_loop(path)
    for node in path:
        kind = _DEFERRED.get(type(node))
        if kind is not None:
            name = f" {node.name}" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ""
            raise ValidationError(
                f"line {call.lineno}: the `.fit(...)` call is inside the {kind}{name} on line "
                f"{getattr(node, 'lineno', '?')}, which runs only when it is called or iterated: %%cloud_fit runs "
                f"the fit the cell itself reaches (at its top level, or in its own for/while loop, if, with or try); "
                f"write `{receiver}.fit(...)` in the cell's own code"
            )
    own = _own_await(tree)
    if own is not None:
        raise ValidationError(
            f"line {getattr(own, 'lineno', '?')}: this cell awaits on its own; %%cloud_fit awaits each fit of a loop "
            "itself and cannot run a cell that awaits too: move the await into a cell of its own"
        )

    class Swap(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            if node is not call:
                return self.generic_visit(node)
            assert isinstance(node.func, ast.Attribute)
            helped = ast.Call(ast.Name(helper, ast.Load()), [node.func.value, *node.args], node.keywords)
            return ast.copy_location(ast.Await(ast.copy_location(helped, node)), node)

    body = Swap().visit(tree)
    last = None
    if body.body and isinstance(body.body[-1], ast.Expr):  # its value is the cell's result, as in any cell
        last = f"{helper}_last"
        tail = body.body[-1]
        body.body[-1] = ast.copy_location(ast.Assign([ast.Name(last, ast.Store())], tail.value), tail)
    filename = remembered(source)
    try:
        code = compile(ast.fix_missing_locations(body), filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:  # what only the compiler sees (`break` outside a loop)
        raise ValidationError(f"the cell is not valid Python: {exc}") from None
    return FitInBlock(code, receiver, call.lineno, last, looped, filename)
