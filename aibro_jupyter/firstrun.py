"""What a first run ends with: the embedded backend it started keeps running, where it is, and how to stop it."""

from __future__ import annotations

import json

from . import config


def embedded_note() -> str | None:
    """The daemon the run started (or reused) keeps running, with a warm worker for the job's cool-down: say so,
    with its pid, URL, home and log, and the command that stops it. None when a configured backend is in use."""
    if config.configured_target() or config.embedded_target() is None:
        return None
    try:
        info = json.loads((config.home() / "backend.json").read_text())
    except (OSError, ValueError):
        return None
    return (
        f"The aibro backend keeps running in the background (pid {info.get('pid')}, {info.get('url', '')}, "
        f"home {config.home()}, log {config.home() / 'backend.log'});\n"
        "its worker process stays warm (about 750 MB of memory) until the job's cool-down ends.\n"
        "Stop both with: aibro backend stop"
    )
