"""The newest events of each job and of each user, kept encoded, so answering a long-poll costs no query and no
JSON encoding.

Under a team's load one worker batch wakes every watcher of its job and of its user, and each of them used to read
the same new rows from SQLite and encode them again: that was most of the backend's time (benchmarks/bench_load.py).
The store adds each committed event here once, encoded once; a page is then a slice of bytes joined.

Correct because the backend is the only writer of the event log and every append goes through
`Store.append_events`: a job's window holds every event of the job after its `base` seq, a user's window every
event of the user after its `base` gid, and a read that starts before a window (a kernel catching up from 0) goes to
SQLite. Windows are bounded (events and bytes each, and how many are kept), so memory is too.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from .jsonout import dumps

WINDOW_EVENTS = 2048  # per job or user; a watcher is normally at most one batch behind
WINDOW_BYTES = 1 << 20
WINDOWS = 512  # jobs and users, least recently written dropped first: at most ~512 MiB, ~100 MiB at typical sizes


def encode_event(event: dict[str, Any]) -> bytes:
    """One event as the API answers it (gid, job_id, seq, type, ts, data), in standard JSON."""
    return dumps(
        {
            "gid": event["gid"],
            "job_id": event["job_id"],
            "seq": event["seq"],
            "type": event["type"],
            "ts": event["ts"],
            "data": event["data"],
        }
    ).encode()


class _Window:
    """A contiguous run of one job's (or user's) newest events: every one after `base`, in key order."""

    __slots__ = ("base", "keys", "parts", "size")

    def __init__(self, base: int) -> None:
        self.base = base
        self.keys: list[int] = []
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, key: int, part: bytes) -> None:
        self.keys.append(key)
        self.parts.append(part)
        self.size += len(part)
        if len(self.keys) > WINDOW_EVENTS or self.size > WINDOW_BYTES:
            drop = max(1, len(self.keys) // 4)  # a quarter at a time: trimming stays amortised O(1)
            self.base = self.keys[drop - 1]
            self.size -= sum(len(p) for p in self.parts[:drop])
            del self.keys[:drop], self.parts[:drop]

    def after(self, after: int, limit: int) -> tuple[list[int], list[bytes]] | None:
        if after < self.base:
            return None
        i = bisect_right(self.keys, after)
        return self.keys[i : i + limit], self.parts[i : i + limit]


class RecentEvents:
    def __init__(self) -> None:
        self._windows: OrderedDict[Hashable, _Window] = OrderedDict()

    def add(self, job_id: str, user_id: int, seq_before: int, events: list[dict[str, Any]]) -> None:
        """Events just committed for one job, in order; `seq_before` is the job's last seq before them."""
        if not events:
            return
        job = self._window(("job", job_id), seq_before)
        user = self._window(("user", user_id), events[0]["gid"] - 1)
        for event in events:
            part = encode_event(event)
            job.add(event["seq"], part)
            user.add(event["gid"], part)

    def job_events(self, job_id: str, after: int, limit: int) -> list[bytes] | None:
        """The job's encoded events after seq `after`, or None when the window does not reach back that far."""
        found = self._read(("job", job_id), after, limit)
        return None if found is None else found[1]

    def user_events(self, user_id: int, after: int, limit: int) -> tuple[list[int], list[bytes]] | None:
        """The user's events after gid `after` (their gids and encodings), or None as for `job_events`."""
        return self._read(("user", user_id), after, limit)

    def _read(self, key: Hashable, after: int, limit: int) -> tuple[list[int], list[bytes]] | None:
        window = self._windows.get(key)
        return None if window is None else window.after(after, limit)

    def _window(self, key: Hashable, base: int) -> _Window:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(base)
            while len(self._windows) > WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return window
