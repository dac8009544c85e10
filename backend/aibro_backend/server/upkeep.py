"""The backend's periodic work besides the scheduler's tick: sweeping stale uploads, tokens and the folders of closed
local instances, adopting and reconciling cloud machines, and the garbage collector's tuning that keeps collections
from stalling the loop."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from tornado.ioloop import IOLoop, PeriodicCallback

from aibro_core.vocabulary import CLOSING, INSTANCE_LIVE

from ..settings import BackendSettings
from ..storage import claims
from ..storage.s3blobs import S3Backing
from .state import Backend

log = logging.getLogger("aibro.backend")


def sweep(backend: Backend) -> None:
    """Partial uploads untouched for the TTL go; so do tokens expired for over a week, and the folders of local
    instances whose worker is gone (the first sweep, at start, those of instances closed while the backend was
    down). With the S3 backing, claims not yet proven are published and upload keys due for deletion go
    (storage/claims.py)."""
    limits = backend.limits
    if backend.blobs.s3 is not None:
        IOLoop.current().spawn_callback(_claims_upkeep, backend, backend.blobs.s3)
    try:
        removed = backend.blobs.sweep_partials(limits.partial_ttl_s)
        if removed:
            log.info("deleted %d partial uploads untouched for %g s", removed, limits.partial_ttl_s)
        backend.store.tokens.drop_expired()
        sweep_worker_folders(backend)
    except Exception:  # noqa: BLE001 - a sweep that fails tries again next time
        log.exception("sweep failed")


def sweep_worker_folders(backend: Backend) -> None:
    """This host's worker folders: only the live instances' stay (providers/local.py, LocalProvider.sweep)."""
    live = backend.store.instances.list(statuses=(*INSTANCE_LIVE, CLOSING))
    removed = backend.local.sweep({i.id: i.pid for i in live if i.provider == backend.local.name})
    if removed:
        log.info("removed the folders of %d closed local instances (their logs are in %s)", removed, backend.local.logs)


async def _claims_upkeep(backend: Backend, s3: S3Backing) -> None:
    try:
        done = await claims.upkeep(backend.store, s3)
    except Exception:  # noqa: BLE001 - tried again at the next sweep
        log.exception("S3 upkeep failed")
        return
    if any(done.values()):
        log.info("S3 upkeep: %d uploads proven and shared, %d upload keys deleted", done["published"], done["deleted"])


# gen0 collections every 20,000 net allocations (not 700), a full one at most every 2,000 of those
GC_THRESHOLDS = (20_000, 20, 100)


def tune_gc() -> None:
    """Keep the cyclic garbage collector from stalling the event loop. Under a team's load a thousand waiting
    long-polls keep ~100,000 objects alive that die a second later, so with Python's default thresholds a full
    collection ran every ~3 s and took ~90 ms (bench_load at 1,500 events/s: 42 of them in two minutes, each one a
    pause for every request). What is alive once the backend is up (modules, routes, providers) is frozen out of
    collections, and collections run less often; reference counting still frees all acyclic garbage at once."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def start_upkeep(backend: Backend) -> PeriodicCallback:
    """Cloud providers outlive the backend: adopt their live machines now (by tag), then reconcile every few
    minutes (AIBRO_RECONCILE_S, default 300: machines the store does not know as live or stopped, or whose time is
    up, are terminated). Both run in the providers' pools; their answers are logged on the loop."""
    sched, loop = backend.scheduler, IOLoop.current()

    def report(what: str) -> Callable[[Any], None]:
        def done(fut: Any) -> None:
            try:
                found = fut.result()
            except Exception as exc:  # noqa: BLE001 - logged; the next round tries again
                log.warning("%s failed: %s", what, exc)
                return
            if found:
                log.info("%s: %s", what, found)

        return done

    adopted = sched.adopt_all()
    for fut in adopted:
        loop.add_future(fut, report("adopted"))

    def reconcile() -> None:
        if any(not f.done() for f in adopted):
            return  # after adoption, never before: the picture must hold what this backend left running
        for fut in sched.reconcile_all():
            loop.add_future(fut, report("reconciled (terminated)"))

    every_s = BackendSettings.from_env().reconcile_s
    reconciler = PeriodicCallback(reconcile, 1000 * every_s)
    if adopted:
        reconciler.start()
    return reconciler
