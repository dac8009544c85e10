"""The one backoff schedule of every retry (worker calls, event batches, S3 parts, EC2 launches): a delay that doubles
from `first` up to `cap`, optionally with full jitter (a random share of it, so many retriers do not march in step),
and `retry`, the one loop that calls something again on the failures worth another try. AWS's own API calls retry
in botocore (its "standard" mode), not here."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class Backoff:
    first: float = 0.2
    cap: float = 2.0
    jitter: bool = False

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try `attempt + 1` (attempt 0 is the first retry)."""
        bound = min(self.cap, self.first * 2 ** min(attempt, 64))
        return random.uniform(0, bound) if self.jitter else bound


WORKER = Backoff(0.2, 2.0)  # a worker calling its backend, which may be restarting
S3_PART = Backoff(0.5, 4.0, jitter=True)  # S3 transfers (and the backend's S3 calls): retriers out of step


def retry(
    call: Callable[[], T],
    *,
    retry_on: RetryOn,
    attempts: int | None = None,
    within_s: float | None = None,
    backoff: Backoff = WORKER,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[Exception, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`call()`, called again after each failure `retry_on` accepts (exception types, or a predicate) while fewer
    than `attempts` tries were made and no more than `within_s` seconds passed since the first (None: no bound);
    `on_retry(exc, n)` hears of failure n (0 first), then `sleep(backoff.delay(n))` runs between the two tries (a
    caller may do more there: restart what broke, ask what arrived; what it raises ends the retry). The last
    failure, or any other, is raised as it is."""
    start = clock()
    for attempt in itertools.count():
        try:
            return call()
        except Exception as exc:
            wanted = retry_on(exc) if _is_predicate(retry_on) else isinstance(exc, retry_on)  # type: ignore[arg-type]
            if not wanted or (attempts is not None and attempt + 1 >= attempts):
                raise
            if within_s is not None and clock() - start > within_s:
                raise
            if on_retry is not None:
                on_retry(exc, attempt)
            sleep(backoff.delay(attempt))
    raise AssertionError("unreachable")


def _is_predicate(retry_on: RetryOn) -> bool:
    return not isinstance(retry_on, (type, tuple))
