"""Waiting inside a cell while the kernel keeps dispatching widget messages.

A cell that blocks its thread starves ipykernel's event loop, so a click on Start, Cancel or Detach would only
arrive after the cell ends (ipykernel 7 no longer lets anyone pump its queue by hand). The magics are therefore
written as coroutines that `await tick()` wherever they wait, and two drivers run them:

* `run_async` is what a notebook cell uses: `%%cloud_fit` and `%cloud_attach` lines are rewritten to an
  `await` (see `awaitable_magics`), ipykernel runs the cell on its own loop, and every tick sleeps on that loop,
  which is what lets comm messages reach the widgets. Ctrl-C cancels the cell; the magic sees KeyboardInterrupt.
* `run_sync` serves plain `run_cell_magic` calls (scripts, terminals): ticks are `time.sleep`, no UI events.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

POLL_S = 0.1
_MAGICS = "get_ipython().magics_manager.registry['CloudMagics']"


class _Tick:
    def __await__(self) -> Generator[None, None, None]:
        yield None


def tick() -> _Tick:
    """Give the driver a chance to wait a little (and the kernel to deliver widget clicks)."""
    return _Tick()


async def until(done: Callable[[], bool]) -> None:
    while not done():
        await tick()


def run_sync(coro: Coroutine[Any, None, Any]) -> Any:
    step: Callable[[], Any] = lambda: coro.send(None)  # noqa: E731
    while True:
        try:
            step()
        except StopIteration as stop:
            return stop.value
        try:
            time.sleep(POLL_S)
            step = lambda: coro.send(None)  # noqa: E731
        except KeyboardInterrupt:
            step = lambda: coro.throw(KeyboardInterrupt())  # noqa: E731


async def run_async(coro: Coroutine[Any, None, Any]) -> Any:
    step: Callable[[], Any] = lambda: coro.send(None)  # noqa: E731
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            step()
        except StopIteration as stop:
            return stop.value
        except KeyboardInterrupt:  # the magic did not handle Ctrl-C: end the cell as interrupted
            raise cancelled or asyncio.CancelledError() from None
        try:
            await asyncio.sleep(POLL_S)
            step = lambda: coro.send(None)  # noqa: E731
        except asyncio.CancelledError as exc:  # ipykernel turns Ctrl-C in an async cell into a cancel
            cancelled = exc
            step = lambda: coro.throw(KeyboardInterrupt())  # noqa: E731


_ATTACH = re.compile(r"^%cloud_attach\b(.*)$")


def awaitable_magics(lines: list[str]) -> list[str]:
    """IPython input transformer: `%%cloud_fit` and `%%cloud_tune` cells and top-level `%cloud_attach` lines become
    awaits."""
    first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if first is None or lines[first].rstrip().endswith("?"):  # `%%cloud_fit?` asks for help
        return lines
    cell = re.match(r"^%%(cloud_fit|cloud_tune)\b", lines[first])
    if cell:
        line = lines[first].rstrip("\n")[len(cell.group(0)) :].strip()
        body = "".join(lines[first + 1 :])
        return [f"await {_MAGICS}.{cell.group(1)}_async({line!r}, {body!r})\n"]
    if lines[first].startswith("%%"):
        return lines
    out = []
    for ln in lines:
        m = None if ln.rstrip().endswith("?") else _ATTACH.match(ln.rstrip("\n"))
        out.append(f"await {_MAGICS}.cloud_attach_async({m.group(1).strip()!r})\n" if m else ln)
    return out
