"""The one backoff schedule of every retry (worker calls, event batches, S3 parts, EC2 calls): a delay that doubles
from `first` up to `cap`, optionally with full jitter (a random share of it, so many retriers do not march in step)."""

from __future__ import annotations

import random
from dataclasses import dataclass


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
S3_PART = Backoff(0.5, 4.0)  # one part of a presigned upload
