"""Wakes long-poll waiters when the event log grows, so they return at once instead of polling."""

from __future__ import annotations

import asyncio


class EventBus:
    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()

    def publish(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)
