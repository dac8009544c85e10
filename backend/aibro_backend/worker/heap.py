"""The warm worker's heap between jobs: the last job's garbage collected now, the rest set aside.

A warm worker runs job after job in one process. Each job leaves a model, its optimizer, traced functions and the
checkpoint copy behind as reference cycles, and Python's full collection runs when enough such objects pile up:
inside the next job's `fit`, where it walks every object TensorFlow and Keras ever made (some 400,000 here, about
0.2 s of one core each time). `settle` runs that collection between jobs instead, then freezes what survives
(`gc.freeze`), so a full collection during a fit walks only that job's own objects. Whatever froze and later became
garbage is unfrozen and collected at the next full `settle`. The agent (issue 40) runs a quick one as each job ends
(the last job's objects only: a study's next trial starts at once) and the full one once the worker has idled
IDLE_S, or every FULL_EVERY_JOBS jobs when they come back to back."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("aibro.worker")
FULL_EVERY_JOBS = 8  # a full settle at least every this many jobs, however busy the worker is
IDLE_S = 2.0  # a worker idle this long after a job settles fully (a study's next trial has come by then)


def settle(full: bool = True) -> float:
    """Collect everything unreachable and freeze the rest; the seconds it took (logged). `full=False` collects only
    what is not frozen yet, the last job's own objects (tens of milliseconds, against half a second for the walk
    over everything TensorFlow made), and leaves what froze earlier and became garbage since for the next full one
    (agent.py runs that when the worker idles, or every FULL_EVERY_JOBS jobs, issue 40)."""
    started = time.perf_counter()
    if full:
        gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    how = "settled" if full else "settled (the last job's objects)"
    log.info("heap %s in %.2f s: %d objects collected, %d frozen", how, took, collected, gc.get_freeze_count())
    return took
