"""A fit's training time and cost on each offered machine, before it starts (issue 38 item 1).

The time of one epoch comes from what is known, best first (`aibro_core.vocabulary.PredictionSource`):

* **history**: this user's earlier jobs of the same model fingerprint (architecture, input shapes, batch size; the
  kernel's `ModelProfile`) on the same machine type (a spot machine and its `.od` twin are one type). Their epoch
  events carry each epoch's seconds and samples per second: the steady epochs (not the first of a job, which also
  traces the model) give the time per sample, scaled to this fit's samples; the first epoch's extra time is added
  once.
* **flops**: the model's training FLOPs per sample against the machine's nominal FP32 throughput (its GPUs' from
  their datasheets, else its vCPUs'), at a fixed fraction of it, plus a fixed overhead per step. A rough guess, and
  said to be one: small Keras models reach a few percent of a machine's peak, big ones much more.

A calibration (a few steps of this model on a warm worker of the type, scaled by a factor per type learned from
history) is meant to slot in between the two as one more estimator of `_ESTIMATORS`: each takes what is known of
one machine type and answers a `Prediction` or None.

The time is the fit's training time (its epochs, validation included as the epochs measured it); getting a
machine, gearing up and sending the data come on top, and are not predicted here yet. The cost is that time at
the machine's price per hour (0 for local, Ray and SSH machines).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from aibro_core import vocabulary as v
from aibro_core.models import Machine, Prediction, PredictionRequest, Predictions

from ..storage.store import Store

# Nominal FP32 throughput, FLOP/s: each GPU model's datasheet figure (NVIDIA), matched by name in the offer's
# gpu_type ("T4", "NVIDIA H200"); a vCPU at 2.5 GHz doing 16 FP32 operations a cycle (one AVX2 FMA pipe's share).
GPU_FP32_FLOPS = {
    "H200": 67e12,
    "H100": 67e12,
    "A100": 19.5e12,
    "A10G": 31.2e12,
    "L40S": 91.6e12,
    "L4": 30.3e12,
    "V100": 15.7e12,
    "T4": 8.1e12,
    "K80": 4.4e12,
}
VCPU_FLOPS = 40e9
# The rough guess's assumptions: the fraction of nominal a Keras fit reaches, and the fixed cost of one step
# (Python, the optimizer's update, a GPU's launches); a calibration will replace both per machine type.
EFFICIENCY = {"cpu": 0.1, "gpu": 0.2}
STEP_OVERHEAD_S = {"cpu": 0.002, "gpu": 0.004}


def machine_type(machine_id: str) -> str:
    """The hardware a machine id names: a spot machine and its on-demand twin `X.od` are one type."""
    return machine_id[:-3] if machine_id.endswith(".od") else machine_id


@dataclass
class Measured:
    """What this user's earlier jobs of one model measured on one machine type."""

    jobs: set[str] = field(default_factory=set)
    per_sample_s: list[float] = field(default_factory=list)  # steady epochs' seconds per training sample
    epoch_s: list[float] = field(default_factory=list)  # steady epochs' seconds (for data of unknown size)
    first_extra_s: list[float] = field(default_factory=list)  # a job's first epoch over its steady ones


def measured(store: Store, user_id: int, fingerprint: str) -> dict[str, Measured]:
    """Machine type → what the user's jobs of this fingerprint measured there (only their epochs that ended)."""
    out: dict[str, Measured] = {}
    for job in store.jobs.list(user_id):
        profile = job.spec.profile if job.spec is not None else None
        if profile is None or profile.fingerprint != fingerprint or not job.machine_id:
            continue
        epochs = [ev["data"] for ev in store.events.typed(job.id, (v.EV_EPOCH,))]
        epochs = [e for e in epochs if isinstance(e.get("seconds"), (int, float))]  # a log's own rows may lack it
        if not epochs:
            continue
        seen = out.setdefault(machine_type(job.machine_id), Measured())
        seen.jobs.add(job.id)
        steady = epochs[1:] or epochs  # a job of one epoch: its only epoch, tracing and all
        rates = [float(e["samples_per_s"]) for e in steady if e.get("samples_per_s")]
        seen.per_sample_s += [1.0 / r for r in rates if r > 0]
        steady_s = [float(e["seconds"]) for e in steady]
        seen.epoch_s += steady_s
        if len(epochs) > 1:
            seen.first_extra_s.append(max(0.0, float(epochs[0]["seconds"]) - statistics.median(steady_s)))
    return out


def from_history(offer: Machine, request: PredictionRequest, seen: Measured | None) -> Prediction | None:
    if seen is None or not seen.epoch_s:
        return None
    extra = statistics.median(seen.first_extra_s) if seen.first_extra_s else 0.0
    count = len(seen.jobs)
    jobs = f"{count} earlier job{'s' if count > 1 else ''} of this model on {machine_type(offer.machine_id)}"
    if request.samples and seen.per_sample_s:
        per_sample = statistics.median(seen.per_sample_s)
        epoch = per_sample * request.samples
        basis = f"{jobs}: {1 / per_sample:,.0f} samples/s over {len(seen.per_sample_s)} epochs"
    else:
        epoch = statistics.median(seen.epoch_s)
        basis = f"{jobs}: {epoch:.1f} s an epoch over {len(seen.epoch_s)} epochs (data of the same size assumed)"
    return _priced(offer, request.epochs * epoch + extra, v.PredictionSource.HISTORY, basis)


def from_flops(offer: Machine, request: PredictionRequest, seen: Measured | None) -> Prediction | None:
    flops = request.profile.flops_per_sample
    if not flops or not request.samples:
        return None
    kind, nominal = nominal_flops(offer)
    steps = math.ceil(request.samples / request.batch_size) if request.batch_size else 1
    epoch = request.samples * flops / (nominal * EFFICIENCY[kind]) + steps * STEP_OVERHEAD_S[kind]
    basis = (
        f"rough guess: {flops / 1e6:,.1f} MFLOPs a sample at {EFFICIENCY[kind]:.0%} of "
        f"{_rate(nominal)} nominal ({_hardware(offer)}) and {STEP_OVERHEAD_S[kind] * 1e3:.0f} ms a step"
    )
    return _priced(offer, request.epochs * epoch, v.PredictionSource.FLOPS, basis)


Estimator = Callable[[Machine, PredictionRequest, "Measured | None"], "Prediction | None"]
_ESTIMATORS: tuple[Estimator, ...] = (from_history, from_flops)  # best first; a calibration goes between them


def nominal_flops(offer: Machine) -> tuple[str, float]:
    """("gpu" or "cpu", the machine's nominal FP32 FLOP/s): its GPUs' when their model is known, else its vCPUs'."""
    if offer.gpu_count and offer.gpu_type:
        name = offer.gpu_type.upper()
        per_gpu = next((f for model, f in GPU_FP32_FLOPS.items() if model in name), None)
        if per_gpu is not None:
            return "gpu", per_gpu * offer.gpu_count
    return "cpu", max(1, offer.vcpus) * VCPU_FLOPS


def _rate(flops: float) -> str:
    return f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.0f} GFLOP/s"


def _hardware(offer: Machine) -> str:
    kind, _ = nominal_flops(offer)
    return f"{offer.gpu_count}x {offer.gpu_type}" if kind == "gpu" else f"{offer.vcpus} vCPUs"


def _priced(offer: Machine, seconds: float, source: v.PredictionSource, basis: str) -> Prediction:
    cost = offer.price_per_hour * seconds / 3600 if offer.price_per_hour else 0.0
    return Prediction(machine_id=offer.machine_id, seconds=seconds, cost=cost, source=source, basis=basis)


def predict(store: Store, user_id: int, offers: list[Machine], request: PredictionRequest) -> Predictions:
    """Each offer's (or each named one's, in the order named) predicted time and cost for the fit, from the best
    source that knows something; an offer nothing is known of gets a prediction with no numbers."""
    if request.machines is not None:
        by_id = {o.machine_id: o for o in offers}
        offers = [by_id[m] for m in request.machines if m in by_id]
    seen = measured(store, user_id, request.profile.fingerprint)
    out = []
    for offer in offers:
        known = seen.get(machine_type(offer.machine_id))
        found = next((p for est in _ESTIMATORS if (p := est(offer, request, known)) is not None), None)
        out.append(
            found
            or Prediction(
                machine_id=offer.machine_id,
                seconds=None,
                cost=None,
                source=None,
                basis="nothing known: no earlier job of this model here, and no FLOPs or sample count to guess from",
            )
        )
    return Predictions(predictions=out)
