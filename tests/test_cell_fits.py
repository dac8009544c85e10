"""How a %%cloud_fit cell is read: a top-level fit statement is split as always; a fit in a loop, an if, a with, a try
or an expression becomes an await of the magic's helper in the cell as written; what cannot run so is refused."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from aibro_jupyter.cellfits import LOOP_COOL_DOWN_S, CellFits
from aibro_jupyter.cellsplit import FitInBlock, SplitCell, fit_cell, split_cell
from aibro_jupyter.errors import ValidationError

pytestmark = pytest.mark.fast

HELPER = "__aibro_fit_test"


def _run(plan: FitInBlock, ns: dict[str, Any]) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Run the rewritten cell with a helper that records each fit and returns a made-up History."""
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    async def helper(receiver: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append((receiver, args, kwargs))
        await asyncio.sleep(0)
        return _History(len(calls))

    ns[HELPER] = helper
    asyncio.run(eval(plan.code, ns))  # noqa: S307 - the test's own cell
    return calls


def test_a_top_level_fit_statement_is_split_as_before() -> None:
    plan = fit_cell("a = 1\nh: object = model.fit(x, y, epochs=2)\nprint(h)\n", HELPER)
    assert isinstance(plan, SplitCell)
    assert len(plan.before) == 1 and len(plan.after) == 1 and plan.target is not None
    assert isinstance(fit_cell("model.fit(x)", HELPER), SplitCell)


def test_a_loop_runs_as_written_each_fit_a_call_of_the_helper() -> None:
    plan = fit_cell(
        "out = []\n"
        "for i in range(3):\n"
        "    out.append(f'before {i}')\n"
        "    h = models[i % 2].fit(x, *more, epochs=1, **extra)\n"
        "    out.append(h)\n"
        "len(out)\n",
        HELPER,
    )
    assert isinstance(plan, FitInBlock) and plan.looped and plan.receiver == "models[i % 2]" and plan.line == 4
    ns: dict[str, Any] = {"models": ["m0", "m1"], "x": "X", "more": ("Y",), "extra": {"batch_size": 8}}
    calls = _run(plan, ns)
    assert calls == [(f"m{i % 2}", ("X", "Y"), {"epochs": 1, "batch_size": 8}) for i in range(3)]
    assert ns["out"] == ["before 0", _History(1), "before 1", _History(2), "before 2", _History(3)]
    assert plan.last is not None and ns[plan.last] == 6, "the final expression's value is the cell's"


@pytest.mark.parametrize(
    "cell, looped",
    [
        ("if ok:\n    h = model.fit(x)\n", False),
        ("with ctx:\n    try:\n        model.fit(x)\n    finally:\n        pass\n", False),
        ("print(model.fit(x).history)\n", False),
        ("a = b = model.fit(x)\n", False),
        ("while n:\n    n -= 1\n    model.fit(x)\n", True),
        ("hs = [model.fit(x) for _ in range(2)]\n", True),
        ("epochs = [e for e in model.fit(x).epoch]\n", False),
        ("for e in range(2):\n    pass\nelse:\n    model.fit(x)\n", False),
    ],
)
def test_where_a_fit_may_sit(cell: str, looped: bool) -> None:
    plan = fit_cell(cell, HELPER)
    assert isinstance(plan, FitInBlock) and plan.looped is looped
    ns: dict[str, Any] = {"model": "m", "x": 1, "ok": True, "ctx": _Ctx(), "n": 2}
    assert [c[0] for c in _run(plan, ns)] == ["m"] * (2 if looped else 1)


class _History(SimpleNamespace):
    def __init__(self, n: int) -> None:
        super().__init__(n=n, history={}, epoch=[0])


class _Ctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    "cell, message",
    [
        ("print(1)", "no `.fit(...)` call in this %%cloud_fit cell"),
        ("for i in r:\n    model.fit(x)\n    model.fit(y)", "2 `.fit(...)` calls in this %%cloud_fit cell"),
        ("model.fit(other.fit(x))", "2 `.fit(...)` calls"),
        ("def train():\n    model.fit(x)\n", "line 2: the `.fit(...)` call is inside the def train on line 1"),
        ("async def train():\n    model.fit(x)\n", "inside the async def train"),
        ("class A:\n    h = model.fit(x)\n", "inside the class A"),
        ("f = lambda: model.fit(x)\n", "inside the lambda"),
        ("hs = (model.fit(x) for _ in r)\n", "inside the generator expression"),
        ("await setup()\nfor i in r:\n    model.fit(x)\n", "line 1: this cell awaits on its own"),
        ("for i in r:\n    model.fit(x)\nbreak\n", "the cell is not valid Python"),
        ("for i in r\n    model.fit(x)\n", "the cell is not valid Python"),
    ],
)
def test_what_is_refused_and_why(cell: str, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        fit_cell(cell, HELPER)
    assert message in str(err.value), str(err.value)


def test_cloud_tune_still_wants_its_search_as_a_statement() -> None:
    with pytest.raises(ValidationError, match="must be a statement of its own"):
        split_cell("for i in r:\n    tuner.search(x, y)\n", "search", "%%cloud_tune")


def test_a_looped_fit_keeps_its_machine_warm_for_the_next_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """300 s, or twice the longest gap seen between passes; an explicit cool-down (option or session) as given; a
    fit that runs once cools as a top-level one."""

    def fits(cell: str, cool_down: float | None = None, session: float | None = None) -> CellFits:
        magics = SimpleNamespace(default_machines=None, default_cool_down=session)
        args = SimpleNamespace(machine="local-cpu", cool_down=cool_down)
        plan = fit_cell(cell, HELPER)
        assert isinstance(plan, FitInBlock)
        return CellFits(magics, args, plan, HELPER)

    loop = fits("for i in r:\n    model.fit(x)\n")
    assert loop._cool_down() == LOOP_COOL_DOWN_S == 300
    loop.gaps = [40.0, 200.0]
    assert loop._cool_down() == 430
    loop.gaps = [5000.0]
    assert loop._cool_down() == 3600, "no more than the backend's default cap"
    assert fits("for i in r:\n    model.fit(x)\n", cool_down=20)._cool_down() == 20
    assert fits("for i in r:\n    model.fit(x)\n", session=0)._cool_down() == 0
    assert fits("if ok:\n    model.fit(x)\n")._cool_down() == 0

    short = fits("for i in r:\n    model.fit(x)\n", cool_down=20)
    short.count, short.ended_at = 2, time.monotonic() - 50
    short._gap(20)
    short._gap(20)
    told = capsys.readouterr().err
    assert told.count("fit 2 started 50 s after fit 1 ended, longer than the cool-down of 20 s") == 1, told
    assert "--cool-down 130 keeps it warm" in told and short.gaps[0] >= 50
