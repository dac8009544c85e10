"""A study's trial machine handed to its next trial (issue 40): the worker that ran a trial stays warm for the
study's next one, which the driver admits as this trial's job ends, so the next trial starts on a worker that
already has the study's data, its build function's code and KerasTuner imported, instead of on a fresh process
(a study with no cool-down otherwise paid a worker's start and TensorFlow's import for every trial). When the study
ends, what it held for no cool-down of the user's closes."""

from __future__ import annotations

from typing import Any

from aibro_core import vocabulary as v

from ..storage.records import JobRecord

HANDOVER_HOLD_S = 60.0  # at most this long; the next trial's job normally comes within a fraction of a second


def handover_hold_s(store: Any, job: JobRecord) -> float:
    """How long the machine that ran `job` stays warm at least: HANDOVER_HOLD_S for a trial of a running study
    (the study's own table says which jobs are its trials), else 0 (the job's own cool-down alone)."""
    found = store.studies.trial_of_jobs(job.user_id, job.id).get(job.id)
    if found is None:
        return 0.0
    study = store.studies.get(found[0])
    return HANDOVER_HOLD_S if study is not None and study.status == v.STUDY_RUNNING else 0.0


def release_held(backend: Any, user_id: int) -> None:
    """A study of `user_id` ended: its machines held only for a next trial (cooling with no cool-down of their
    own) close now, unless another running study of the user may take them."""
    store = backend.store
    if any(s.user_id == user_id for s in store.studies.list(statuses=(v.STUDY_RUNNING,))):
        return
    for inst in store.instances.list(user_id, (v.COOLING,)):
        if inst.cool_down_s <= 0:
            backend.scheduler.close_instance(inst)
