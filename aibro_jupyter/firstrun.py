"""What a first run ends with: the embedded backend it started keeps running, where it is, and how to stop it."""

from __future__ import annotations

from . import config
from .settings import KernelSettings


def embedded_note() -> str | None:
    """The daemon the run started (or reused) keeps running, with warm workers (the job's for its cool-down, and the
    spare the embedded backend keeps): say so, with its pid, URL, home and log, and the command that stops them.
    None when a configured backend is in use."""
    if config.configured_target() or config.embedded_target() is None:
        return None
    info = config._read_json(config.home() / "backend.json") or {}
    spare = ", and a spare one ready for the next job" if KernelSettings.from_env().spare_worker else ""
    return (
        f"The aibro backend keeps running in the background (pid {info.get('pid')}, {info.get('url', '')}, "
        f"home {config.home()}, log {config.home() / 'backend.log'});\n"
        f"its workers stay warm (about 0.5–0.8 GB of memory each): the job's until its cool-down ends{spare}.\n"
        "Stop the backend and its workers with: aibro backend stop"
    )
