"""A fit's predicted time and cost on each machine, as the kernel asks for them and says them (issue 38):
`Training.predict` and `%cloud_machines --predict`. The backend predicts (POST /predictions): only it holds the
earlier jobs' measured epochs."""

from __future__ import annotations

from typing import Any

from aibro_core import vocabulary as v
from aibro_core.models import Prediction, PredictionRequest

from . import bundle as b
from .checks import fit_batch_size
from .dataset_blob import is_dataset
from .fitrequest import FitRequest
from .modelprofile import model_profile, samples
from .prices import money

KERAS_BATCH_SIZE = 32  # what Keras' fit uses for arrays when given no batch_size


def effective_batch_size(batch_size: Any, x: Any) -> int | None:
    """The batch size the fit trains with: the one given (as the backend takes it), Keras' 32 for arrays, None for a
    dataset (it batches itself)."""
    given = fit_batch_size(batch_size, "batch_size", None if is_dataset(x) else x)
    return given if given is not None or is_dataset(x) else KERAS_BATCH_SIZE


def prediction_request(request: FitRequest, machines: list[str] | None = None) -> PredictionRequest:
    """What the backend needs to predict the fit `request` describes: the model's profile, the epochs, the samples
    an epoch sees and the batch size. The model is built from one sample of the data if it is not yet, as fit
    would."""
    model, x = request.model, request.train_X
    b.build_from_data(model, x)
    batch_size = effective_batch_size(request.batch_size, x)
    fit_kwargs = request.fit_kwargs or {}
    return PredictionRequest(
        profile=model_profile(model, x, batch_size),
        epochs=int(fit_kwargs.get("epochs", request.epochs)) - int(fit_kwargs.get("initial_epoch") or 0),
        samples=samples(x),
        batch_size=batch_size,
        machines=machines,
    )


def duration(seconds: float) -> str:
    """ "45 s", "14 min", "2.5 h": as precise as a prediction is."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def estimate(cost: float) -> str:
    """A predicted cost: "free" for a machine that costs nothing, "<$0.01", else dollars to the cent."""
    if not cost:
        return "free"
    return "<$0.01" if cost < 0.01 else money(cost)


def shown(p: Prediction | None) -> tuple[str, str, str]:
    """A prediction as the text listing and the picker say it: its time, its cost ("—" where nothing is known; "~"
    marks a rough guess) and where they came from."""
    if p is None:
        return "—", "—", "nothing known"
    rough = "~" if p.source == v.PredictionSource.FLOPS else ""
    time_ = rough + duration(p.seconds) if p.seconds is not None else "—"
    cost = (rough if p.cost else "") + estimate(p.cost) if p.cost is not None else "—"
    return time_, cost, f"{p.source}: {p.basis}" if p.source is not None else p.basis


def format_predictions(predictions: list[Prediction]) -> str:
    """One line per machine: its predicted time and cost, and what the numbers rest on."""
    head = f"{'machine_id':<16} {'time':>8} {'cost':>8}  from"
    rows = [head, "-" * len(head)]
    for p in predictions:
        time_, cost, source = shown(p)
        rows.append(f"{p.machine_id:<16} {time_:>8} {cost:>8}  {source}")
    return "\n".join(rows)
