"""The warm worker's heap between jobs: the last job's garbage collected now, the rest set aside.

A warm worker runs job after job in one process. Each job leaves a model, its optimizer, traced functions and the
checkpoint copy behind as reference cycles, and Python's full collection runs when enough such objects pile up:
inside the next job's `fit`, where it walks every object TensorFlow and Keras ever made (some 400,000 here, about
0.2 s of one core each time). `settle` runs that collection between jobs instead, then freezes what survives
(`gc.freeze`), so a full collection during a fit walks only that job's own objects. Whatever froze and later became
garbage is unfrozen and collected at the next `settle`, so nothing stays frozen for longer than one job.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("aibro.worker")


def settle() -> float:
    """Collect everything unreachable and freeze the rest; the seconds it took (logged)."""
    started = time.perf_counter()
    gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    log.info("heap settled in %.2f s: %d objects collected, %d frozen", took, collected, gc.get_freeze_count())
    return took
