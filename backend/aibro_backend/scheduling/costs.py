"""What a job and an instance cost, from the instance's state history and the price it was started at.

EC2 bills Linux instances per second with a 60 s minimum each time an instance starts (a launch, or a restart of a
stopped one), from `running` until it is stopping or shutting down. The backend does not see `running` itself, so
a start is billed from its LAUNCHING transition (the launch or start call: a few seconds more than EC2 bills)
to its first CLOSING/CLOSED one (the stop or terminate call). Whole seconds, rounded up.

Who pays for what (README "Training on AWS" → Costs says the same):
* A job pays for the seconds its instance held it: LAUNCHING for it (the machine booting) and EXECUTING it.
* The job that started the instance (a launch or a restart) also pays that start's rounding and 60 s minimum.
* Cooling (kept warm after a job) is billed to the instance only, never to a job: a job's cost is final when it
  ends, and whether warm time was wasted or saved the next job a launch is only known later. The instances view
  shows it as `cooling_cost`; an instance's `cost` is the sum of its jobs' share and its cooling.
* A start whose machine never reported to the backend (never EXECUTING: a launch EC2 refused, or a machine lost
  while booting) is billed its seconds without the minimum; EC2 bills nothing for a refused launch.
Prices are the instance row's `price_per_hour`, written when it started (the offer's spot or on-demand price then);
local and cluster machines are 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aibro_core import vocabulary as v

from ..storage.records import InstanceRecord

MIN_BILLED_S = 60.0
RUNNING = (v.LAUNCHING, v.EXECUTING, v.COOLING)  # the states in which the machine is up, so billed


def billed_seconds(seconds: float, reported: bool = True) -> float:
    """EC2's billed seconds for one start that ran `seconds`: whole seconds up, at least 60 once it ran."""
    whole = float(math.ceil(max(0.0, seconds) - 1e-9))
    return max(MIN_BILLED_S, whole) if reported else whole


@dataclass
class Start:
    """One start of an instance (launch or restart) up to its stop or terminate: its billed stretches."""

    begin: float
    end: float
    first_job: str | None = None
    reported: bool = False
    job_seconds: dict[str, float] = field(default_factory=dict)
    cooling_seconds: float = 0.0


def starts(history: Sequence[Sequence[Any]], now: float) -> list[Start]:
    """The instance's starts from its history of [status, substatus, ts(, job_id)] entries; a start still
    running ends at `now`."""
    out: list[Start] = []
    cur: Start | None = None
    for i, entry in enumerate(history):
        status, ts = entry[0], float(entry[2])
        job = entry[3] if len(entry) > 3 else None
        if status not in RUNNING:
            if cur is not None:
                cur.end = ts
                cur = None
            continue
        if cur is None:
            cur = Start(begin=ts, end=now)
            out.append(cur)
        nxt = float(history[i + 1][2]) if i + 1 < len(history) else max(now, ts)
        seconds = max(0.0, nxt - ts)
        if status == v.EXECUTING:
            cur.reported = True
        if status == v.COOLING or not job:
            cur.cooling_seconds += seconds
            continue
        if cur.first_job is None:
            cur.first_job = job
        cur.job_seconds[job] = cur.job_seconds.get(job, 0.0) + seconds
    return out


@dataclass
class InstanceCost:
    cost: float
    cooling_cost: float
    billed_s: float
    by_job: dict[str, float]


def instance_cost(inst: InstanceRecord, now: float) -> InstanceCost:
    """The instance's cost so far in USD, its cooling part, billed seconds, and each job's share."""
    price = float(inst.price_per_hour or 0.0) / 3600.0
    total = cooling = billed_total = 0.0
    by_job: dict[str, float] = {}
    for start in starts(inst.history or [], now):
        used = sum(start.job_seconds.values()) + start.cooling_seconds
        billed = billed_seconds(start.end - start.begin, start.reported)
        extra = max(0.0, billed - used)  # rounding and the minimum: the starting job's, else the instance's
        billed_total += billed
        total += billed * price
        for job, seconds in start.job_seconds.items():
            share = seconds + (extra if job == start.first_job else 0.0)
            by_job[job] = by_job.get(job, 0.0) + share * price
        cooling += (start.cooling_seconds + (extra if start.first_job is None else 0.0)) * price
    return InstanceCost(round(total, 6), round(cooling, 6), billed_total, {j: round(c, 6) for j, c in by_job.items()})


def job_costs(instances: Iterable[dict[str, Any]], now: float) -> dict[str, float]:
    """Each job's cost in USD over every instance it held (a resumed job held several)."""
    out: dict[str, float] = {}
    for inst in instances:
        for job, cost in instance_cost(inst, now).by_job.items():
            out[job] = round(out.get(job, 0.0) + cost, 6)
    return out
