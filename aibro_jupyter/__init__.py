"""aibro-jupyter: train a Keras model on a remote machine straight from a notebook cell."""

from __future__ import annotations

from .errors import AibroError, ApiError, AuthError, BackendUnreachable, JobFailed, ValidationError
from .training import Training, available_machines, get_tensorboard_logs, plot_timeline, replay_job

__version__ = "0.1.0"
__all__ = [
    "AibroError",
    "ApiError",
    "AuthError",
    "BackendUnreachable",
    "JobFailed",
    "Training",
    "ValidationError",
    "available_machines",
    "get_tensorboard_logs",
    "plot_timeline",
    "replay_job",
]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """Jupyter server finds the /aibro/api proxy here (enabled on install by jupyter-config/)."""
    return [{"module": "aibro_jupyter.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "aibro-jupyter"}]


def load_ipython_extension(ipython) -> None:  # noqa: ANN001
    """`%load_ext aibro_jupyter` registers the %%cloud_fit family of magics."""
    from .magics import load_ipython_extension as load

    load(ipython)
