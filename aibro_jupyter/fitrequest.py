"""One remote fit as the user asked for it: the one list of the options `Training.prepare` and `submit`, the
checks (`checks.py`), the magics, `aibro fit` and the search pass along.

A frozen dataclass, not a pydantic model: it carries the user's own objects as they were given (a Keras model,
arrays, memmaps, datasets, callbacks) and must neither copy nor coerce them, since `checks.py` judges each value
itself and names a bad one the way the user typed it (`--cool-down` in `%%cloud_fit`); the job spec the backend
validates is made from it later (`aibro_core.models.JobSpec`). Frozen, because whoever it is handed to reads what
the user asked for and changes nothing of it (`dataclasses.replace` makes a changed copy). A module of its own,
because `checks.py` reads it and `training.py` imports `checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class FitRequest:
    """`model.fit(train_X, train_Y, ...)` on `machine_ids`, with the job's own options.

    `argnames` maps these field names to what the user typed (`{"cool_down_period_s": "--cool-down"}`), so errors
    name the argument the user knows. `build` (a search's build function or HyperModel class, search.py) makes
    `model` one it built, checked against the data but not sent: the function travels as code and the spec's
    `trial` names it; `hypermodel_fit` (a HyperModel whose own fit trains the model) checks neither the data nor
    the compile against that model. `workers` > 1 trains the one fit on that many workers together (gangcheck.py)."""

    model: Any
    train_X: Any
    train_Y: Any = None
    machine_ids: str | list[str] | None = None
    batch_size: int | None = None
    epochs: int = 1
    validation_data: Any = None
    description: str = ""
    cool_down_period_s: float = 0
    fit_kwargs: dict[str, Any] | None = None
    wait_request_s: float = 60
    wait_new_job_create_s: float = 0
    wait_new_job_create_interval: float = 5
    record: bool = True
    safe_mode: bool = True
    meta: dict[str, str] | None = None
    requirements: list[str] | str | None = None
    argnames: dict[str, str] | None = None
    build: Any = None
    hypermodel_fit: bool = False
    workers: int = 1

    @property
    def sample_weight(self) -> Any:
        """fit's `sample_weight`, which travels among the fit's keyword arguments."""
        return (self.fit_kwargs or {}).get("sample_weight")

    @classmethod
    def of_call(cls, arguments: dict[str, Any], **given: Any) -> FitRequest:
        """The request a user-facing call makes (`Training.online_fit`, whose signature is the user's): each of its
        `arguments` (its `locals()`) that names a field, then `given`, so the list of options is this class's."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: val for k, val in arguments.items() if k in names}, **given})
