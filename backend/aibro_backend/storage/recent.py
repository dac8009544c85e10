"""The newest events of each job and of each user, kept encoded, so answering a long-poll costs no query and no
JSON encoding.

Under a team's load one worker batch wakes every watcher of its job and of its user, and each of them used to read
the same new rows from SQLite and encode them again: that was most of the backend's time (benchmarks/bench_load.py).
The store adds each committed event here once, encoded once; a page is then a slice of bytes joined.

Correct because the backend is the only writer of the event log and every append goes through
`Events.append_batches`: a job's window holds every event of the job after its `base` seq, a user's window every
event of the user after its `base` gid, and a read that starts before a window (a kernel catching up from 0) goes to
SQLite. Windows are bounded (events and bytes each, all of them together, and how many), so memory is too.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable
from json.encoder import encode_basestring_ascii as quote

from aibro_core.jsonout import dumps

# Per job or user: a watcher is normally one batch behind, but one that fell behind under load must still be
# answered from here (reading the log costs it more, which would make it fall further behind).
WINDOW_EVENTS = 10_000
WINDOW_BYTES = 2 << 20
BUDGET_BYTES = 128 << 20  # all windows together; the least recently written go first
WINDOWS = 4096


def encode_event(gid: int, job_id: str, seq: int, type_: str, ts: float, data_json: str) -> bytes:
    """One event as the API answers it: {gid, job_id, seq, type, ts, data}, built around the data's JSON as the
    log stores it (so neither the window nor a read from the log encodes the data again). Standard JSON only: a
    row an older backend stored with NaN or Infinity is re-encoded with those as null."""
    if "NaN" in data_json or "Infinity" in data_json:
        data_json = dumps(json.loads(data_json))
    ts_json = repr(float(ts)) if math.isfinite(ts) else "null"
    return (
        f'{{"gid": {int(gid)}, "job_id": {quote(job_id)}, "seq": {int(seq)}, "type": {quote(type_)}, '
        f'"ts": {ts_json}, "data": {data_json}}}'
    ).encode()


class _Window:
    """A contiguous run of one job's (or user's) newest events: every one after `base`, in key order."""

    __slots__ = ("base", "keys", "parts", "size")

    def __init__(self, base: int) -> None:
        self.base = base
        self.keys: list[int] = []
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, key: int, part: bytes) -> int:
        """Append one event; returns how many bytes the window grew (negative when it was trimmed)."""
        before = self.size
        self.keys.append(key)
        self.parts.append(part)
        self.size += len(part)
        if len(self.keys) > WINDOW_EVENTS or self.size > WINDOW_BYTES:
            drop = max(1, len(self.keys) // 4)  # a quarter at a time: trimming stays amortised O(1)
            self.base = self.keys[drop - 1]
            self.size -= sum(len(p) for p in self.parts[:drop])
            del self.keys[:drop], self.parts[:drop]
        return self.size - before

    def after(self, after: int, limit: int) -> tuple[list[int], list[bytes]] | None:
        if after < self.base:
            return None
        i = bisect_right(self.keys, after)
        return self.keys[i : i + limit], self.parts[i : i + limit]


class RecentEvents:
    def __init__(self) -> None:
        self._windows: OrderedDict[Hashable, _Window] = OrderedDict()
        self.size = 0  # bytes held by all windows

    def add(self, job_id: str, user_id: int, seq_before: int, events: list[tuple[int, int, bytes]]) -> None:
        """Events just committed for one job, in order, as (gid, seq, encoding); `seq_before` is the job's last
        seq before them."""
        if not events:
            return
        job = self._window(("job", job_id), seq_before)
        user = self._window(("user", user_id), events[0][0] - 1)
        for gid, seq, part in events:
            self.size += job.add(seq, part) + user.add(gid, part)
        while self.size > BUDGET_BYTES and len(self._windows) > 2:
            self.size -= self._windows.popitem(last=False)[1].size

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
                self.size -= self._windows.popitem(last=False)[1].size
        else:
            self._windows.move_to_end(key)
        return window
