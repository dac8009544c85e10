"""One backoff schedule for every retry (issue 25 item 4): it doubles from its first delay up to its cap, and with
jitter stays within that bound."""

from __future__ import annotations

import pytest

from aibro_core.backoff import S3_PART, WORKER, Backoff

pytestmark = pytest.mark.fast


def test_it_doubles_up_to_its_cap() -> None:
    assert [WORKER.delay(n) for n in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert [S3_PART.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert WORKER.delay(10_000) == 2.0, "a long outage never overflows"


def test_jitter_stays_within_the_bound() -> None:
    b = Backoff(0.5, 8.0, jitter=True)
    for n in range(8):
        assert all(0 <= b.delay(n) <= min(8.0, 0.5 * 2**n) for _ in range(50))
