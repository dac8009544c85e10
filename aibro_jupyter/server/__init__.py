"""Jupyter server extension: `/aibro/api/*` proxies the backend behind Jupyter's own auth.

The browser never sees the backend's URL or token; the extension holds them (and starts the embedded backend
when none is configured)."""

from __future__ import annotations

from typing import Any

from .handlers import setup_handlers
from .upstream import Upstream


def _load_jupyter_server_extension(server_app: Any) -> None:
    upstream = Upstream(log=server_app.log)
    server_app.io_loop.add_callback(upstream.warm_up)  # runs once the loop starts
    setup_handlers(server_app.web_app, upstream)
    server_app.log.info("aibro_jupyter: /aibro/api/* proxies the aibro backend")
