"""Wakes long-poll waiters when the event log grows, so they return at once instead of polling.

Keyed: a stored event wakes only the long-polls of its job and of its user. With one shared wake-up, every event
of any job woke every waiter in the backend (a thousand watchers each re-reading the store for each of thousands
of events a second); keyed, an event costs its own watchers only."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Key = tuple[str, Any]


def job_key(job_id: str) -> Key:
    """The waiters of one log: a job's, or a study's (its id is its log's name, storage/events.py)."""
    return ("job", job_id)


def user_key(user_id: int) -> Key:
    return ("user", user_id)


class EventBus:
    def __init__(self) -> None:
        self._waiters: defaultdict[Key, set[asyncio.Future]] = defaultdict(set)
        self.closed = False
        # called with each published event, on the loop: the backend's own followers (the study driver)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def close(self) -> None:
        """The backend is stopping: every long-poll answers now (a task still waiting when the loop ends is
        cancelled, and tornado answers a cancelled handler with a 500)."""
        self.closed = True
        self.publish()

    def publish(self, event: dict[str, Any] | None = None) -> None:
        """Wake the waiters of this event's job (or study) and user, then tell the listeners; with no event, wake
        every waiter."""
        if event is None:
            keys = list(self._waiters)
        else:
            keys = [job_key(event["job_id"]), user_key(event["user_id"])]
        for key in keys:
            for fut in self._waiters.pop(key, ()):
                _release(fut)
        if event is not None:
            for listener in self.listeners:
                listener(event)

    async def wait(self, timeout: float, key: Key) -> None:
        """Return when an event under `key` is published, or after `timeout` seconds. A timer resolves the same
        future a publish would (no asyncio.wait_for: nothing is cancelled when a long-poll simply runs out)."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters[key].add(fut)
        timer = loop.call_later(max(0.0, timeout), _release, fut)
        try:
            await fut
        finally:
            timer.cancel()
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(fut)
                if not waiting:
                    del self._waiters[key]


def _release(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
