"""The warm worker's heap between jobs (backend/aibro_backend/worker/heap.py): a job's garbage is collected when
the job ends, and what was frozen then is still collected once it becomes garbage, at the next full settle (the
next job's end, or, between a study's back-to-back trials, when the worker idles: issue 40)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.fast

SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from aibro_backend.worker import heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    done = cycle()
    gone = weakref.ref(done)
    del done  # the finished job's model: garbage in a reference cycle
    kept = cycle()  # something alive when the job ended (frozen by settle)
    kept_ref = weakref.ref(kept)
    heap.settle()
    assert gone() is None, "the finished job's cycle survived settle"
    assert gc.get_freeze_count() > 0, "settle froze nothing"
    del kept  # it becomes garbage during the next job
    gc.collect()
    assert kept_ref() is not None, "a frozen object was collected by an ordinary collection"
    heap.settle()  # the next job's end
    assert kept_ref() is None, "an object frozen at one job's end leaked past the next"

    done = cycle()  # a job between two others: the quick settle after it collects its garbage
    gone = weakref.ref(done)
    del done
    kept = cycle()
    kept_ref = weakref.ref(kept)
    heap.settle(full=False)
    assert gone() is None, "a quick settle left the job's own garbage"
    del kept
    heap.settle(full=False)
    assert kept_ref() is not None, "a quick settle walked what was frozen"
    heap.settle(full=True)  # the worker idles: the full one
    assert kept_ref() is None, "the full settle left what froze and became garbage since"
    print("ok")
    """
)


def test_settle_collects_each_jobs_garbage_and_leaks_nothing_frozen() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
