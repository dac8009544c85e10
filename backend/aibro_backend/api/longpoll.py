"""The event long-polls (a job's events, a study's events, a user's events), apart from any HTTP server.

Both the tornado routes (api/user.py) and the lean event port (eventport.py) answer them through these functions,
so the checks, the waiting and the page are one code: a page is `{"events": [...], ...}` built from events encoded
once when they were committed (recent.py), with no query and no JSON encoding per watcher."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError as PydanticError

from aibro_core import vocabulary as v
from aibro_core.jobpicture import JobPicture
from aibro_core.jsonout import dumps
from aibro_core.models import INT64_MAX, EventsQuery

from ..server.state import Backend
from ..storage.bus import job_key, user_key
from .base import ApiError, not_yours

MAX_WAIT_S = 60.0
QUERY_MESSAGES = {
    "after": f"'after' must be an integer from 0 to {INT64_MAX} (the last seq or cursor you have)",
    "wait": "'wait' must be a finite number of seconds, 0 or more (at most 60 are waited)",
}


def after_wait(raw: dict[str, str]) -> tuple[int, float]:
    """`?after=&wait=` from the query's text values; a bad one is a 400 naming it, its rule and what came."""
    try:
        q = EventsQuery.model_validate(raw)
    except PydanticError as exc:
        err = exc.errors(include_url=False)[0]
        name = str(err["loc"][0]) if err.get("loc") else ""
        got = raw.get(name)
        shown = "nothing" if got is None else repr(got[:40])
        raise ApiError(400, f"{QUERY_MESSAGES.get(name, f'{name!r} is not valid')}, got {shown}") from None
    return q.after, min(q.wait, MAX_WAIT_S)


def page(parts: list[bytes], **fields: Any) -> bytes:
    """A page of already encoded events as `{"events": [...], **fields}`."""
    return b'{"events":[' + b",".join(parts) + b"]," + dumps(fields)[1:].encode()


async def job_events(backend: Backend, uid: int, job_id: str, after: int, wait: float) -> bytes:
    """The job's events after seq `after`, waiting up to `wait` s for one; 404 unless the job is this user's.
    The status is read first: a final status is committed with its event, so a final page is never short."""
    store, bus = backend.store, backend.bus
    state = store.jobs.state(job_id, uid)
    if state is None:
        raise not_yours(job_id)
    deadline = time.monotonic() + wait
    parts = store.events.parts(job_id, after)
    while not parts and state[0] not in v.JOB_FINAL and time.monotonic() < deadline and not bus.closed:
        await bus.wait(deadline - time.monotonic(), job_key(job_id))
        state = store.jobs.state(job_id) or state
        parts = store.events.parts(job_id, after)
    status, substatus = _job_state(job_id, state, store)
    return page(parts, status=status, substatus=substatus)


async def study_events(backend: Backend, uid: int, study_id: str, after: int, wait: float) -> bytes:
    """The study's own events (`study`: trials started and ended, the study's end) after seq `after`, waiting up
    to `wait` s for one, as a job's; 404 unless the study is this user's. The page carries the study's status: a
    study's `study ended` event is appended before its final status, so a final page with no events is the end."""
    store, bus = backend.store, backend.bus
    study = store.studies.get(study_id, uid)
    if study is None:
        raise ApiError(404, f"no study '{study_id[:80]}' for this user: GET /studies lists yours")
    status = study.status
    deadline = time.monotonic() + wait
    parts = store.events.parts(study_id, after)
    while not parts and status not in v.STUDY_FINAL and time.monotonic() < deadline and not bus.closed:
        await bus.wait(deadline - time.monotonic(), job_key(study_id))
        status = getattr(store.studies.get(study_id), "status", status)
        parts = store.events.parts(study_id, after)
    return page(parts, status=status)


async def user_events(backend: Backend, uid: int, after: int, wait: float) -> bytes:
    """Every event of the user's jobs after cursor `after`, waiting up to `wait` s for one."""
    store, bus = backend.store, backend.bus
    deadline = time.monotonic() + wait
    parts, cursor = store.events.user_parts(uid, after)
    while not parts and time.monotonic() < deadline and not bus.closed:
        await bus.wait(deadline - time.monotonic(), user_key(uid))
        parts, cursor = store.events.user_parts(uid, after)
    return page(parts, cursor=cursor)


def _job_state(job_id: str, state: tuple[str, str], store: Any) -> tuple[str, str]:
    """The job's status and substatus; for a row a worker spoiled before events were validated, the last valid
    ones its events give."""
    if state[0] in v.JOB_STATUSES and state[1] in v.JOB_SUBSTATUSES:
        return state
    picture = JobPicture().apply_all(store.events.typed(job_id, (v.EV_STATUS,)))
    return picture.status, picture.substatus
