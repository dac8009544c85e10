"""The cell-waiting drivers and the input transformer that lets widget clicks reach a running %%cloud_fit."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from aibro_jupyter.cellwait import awaitable_magics, run_async, run_sync, until

pytestmark = pytest.mark.fast


def _transform(cell: str) -> str:
    tm = TransformerManager()
    tm.cleanup_transforms.append(awaitable_magics)
    return tm.transform_cell(cell)


def test_cloud_fit_cell_becomes_one_await_with_line_and_body_intact() -> None:
    out = _transform("\n%%cloud_fit -m local-cpu -d 'a b'\nx = 1\nh = model.fit(x, y)\n")
    assert out.startswith("await get_ipython().magics_manager.registry['CloudMagics'].cloud_fit_async(")
    assert "\"-m local-cpu -d 'a b'\"" in out and "'x = 1\\nh = model.fit(x, y)\\n'" in out
    compile(out, "<cell>", "exec", flags=0x2000)  # PyCF_ALLOW_TOP_LEVEL_AWAIT


def test_attach_lines_become_awaits_and_everything_else_is_left_alone() -> None:
    out = _transform("a = 1\n%cloud_attach job-1 --into m\nprint(a)\n")
    assert out == (
        "a = 1\nawait get_ipython().magics_manager.registry['CloudMagics'].cloud_attach_async('job-1 --into m')\n"
        "print(a)\n"
    )
    assert "await" not in _transform("%%cloud_fit?\n") and "await" not in _transform("%cloud_attach?\n")
    assert "await" not in _transform("%%time\n%cloud_attach job-1\n")
    assert "await" not in _transform("%cloud_jobs\nx = 2\n")


async def _waits(flag: threading.Event, log: list[str]) -> str:
    try:
        await until(flag.is_set)
    except KeyboardInterrupt:
        log.append("interrupted")
        return "detached"
    return "done"


def test_run_async_lets_the_loop_run_while_waiting() -> None:
    flag, log = threading.Event(), []

    async def main() -> str:
        asyncio.get_running_loop().call_later(0.3, flag.set)  # only runs if the wait yields to the loop
        return await run_async(_waits(flag, log))

    assert asyncio.run(main()) == "done" and log == []


def test_cancel_reaches_the_magic_as_keyboard_interrupt() -> None:
    flag, log = threading.Event(), []

    async def main() -> str:
        task = asyncio.ensure_future(run_async(_waits(flag, log)))
        asyncio.get_running_loop().call_later(0.3, task.cancel)  # what ipykernel does on Ctrl-C in an async cell
        return await task

    assert asyncio.run(main()) == "detached" and log == ["interrupted"]


def test_run_sync_turns_sigint_into_keyboard_interrupt_inside_the_magic() -> None:
    """Ctrl-C in a terminal or script: Python's default SIGINT handler raises KeyboardInterrupt, and run_sync hands
    it to the magic. The test installs that handler itself, since a runner started with SIGINT ignored (`nohup ...
    &`) passes SIG_IGN on to us, and a guard timer ends the wait after 10 s so a lost signal fails instead of hangs."""
    flag, log = threading.Event(), []
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt = threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGINT))
    guard = threading.Timer(10.0, flag.set)
    try:
        interrupt.start()
        guard.start()
        result = run_sync(_waits(flag, log))
    finally:
        interrupt.cancel()
        guard.cancel()
        signal.signal(signal.SIGINT, old)
    assert result == "detached" and log == ["interrupted"], "SIGINT did not reach the magic within 10 s"


def test_unhandled_interrupt_ends_the_cell_as_cancelled() -> None:
    async def ignores() -> None:
        await until(lambda: False)

    async def main() -> None:
        task = asyncio.ensure_future(run_async(ignores()))
        asyncio.get_running_loop().call_later(0.2, task.cancel)
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
