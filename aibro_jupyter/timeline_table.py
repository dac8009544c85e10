"""`%cloud_timeline`'s text: per job the seconds spent gearing up, by substatus, the training time and the cost.

Gear-up is everything before the first batch: REQUESTING SERVER (queued, waiting for a machine), CONNECTING
SERVER (the machine launching or restarting, its agent connecting), GEARING UP ENV (the Python environment) and
SENDING MODEL & DATA. Which of them dominates tells a new launch from a stopped restart from a warm reuse.
"""

from __future__ import annotations

from aibro_core import vocabulary as v
from aibro_core.models import Job, TimelineEntry

from .widgets.timeline import durations

GEAR_UP = (v.REQUESTING_SERVER, v.CONNECTING_SERVER, v.GEARING_UP_ENV, v.SENDING_MODEL_DATA)
COLUMNS = (("REQUESTING", v.REQUESTING_SERVER), ("CONNECTING", v.CONNECTING_SERVER), ("GEARING UP", v.GEARING_UP_ENV))
COLUMNS += (("SENDING", v.SENDING_MODEL_DATA), ("TRAINING", v.SUB_TRAINING), ("RETURNING", v.RETURNING))


def per_substatus(timeline: list[TimelineEntry], now: float | None = None) -> dict[str, float]:
    """Seconds per substatus over the whole timeline (a resumed job's second gear-up adds to the first)."""
    out: dict[str, float] = {}
    for name, seconds in durations(timeline, now):
        out[name] = out.get(name, 0.0) + seconds
    return out


def gear_up_s(timeline: list[TimelineEntry], now: float | None = None) -> float:
    """Seconds the job spent before it trained: the gear-up substatuses summed."""
    spent = per_substatus(timeline, now)
    return sum(spent.get(name, 0.0) for name in GEAR_UP)


def format_timelines(jobs: list[Job], now: float | None = None) -> str:
    """One row per job: machine, status, seconds per substatus, gear-up total, cost in USD."""
    names = [label for label, _ in COLUMNS]
    head = f"{'job_id':<24} {'machine':<16} {'status':<10} " + " ".join(f"{n:>10}" for n in names)
    head += f" {'gear-up':>8} {'cost $':>9}"
    rows = [head, "-" * len(head)]
    for job in jobs:
        spent = per_substatus(job.timeline, now)
        cells = " ".join(f"{spent.get(sub, 0.0):>9.1f}s" for _, sub in COLUMNS)
        rows.append(
            f"{job.job_id:<24} {job.machine_id or '-':<16} {job.status:<10} {cells} "
            f"{gear_up_s(job.timeline, now):>7.1f}s {job.cost:>9.4f}"
        )
    return "\n".join(rows)


JOBS_HEAD = f"{'job_id':<24} {'status':<10} {'substatus':<22} {'epochs':>7} {'machine':<12} description"


def job_row(job: Job) -> str:
    """A job's line under JOBS_HEAD (`%cloud_jobs`, `aibro jobs`): status, substatus, epochs done, machine."""
    ep = f"{job.epochs_done}/{job.epochs}"
    return (
        f"{job.job_id:<24} {job.status:<10} {job.substatus:<22} {ep:>7} {job.machine_id or '-':<12} {job.description}"
    )
