"""The backend the server extension talks to, found (or started) once and re-found after it restarts."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from .. import config
from ..client import Transport
from ..errors import AibroError, BackendUnreachable

LONG_POLL_SLACK_S = 15.0


class Upstream:
    """Forwards calls through the one HTTP client (`client.Transport`), on a thread pool so long-polls never
    block Jupyter's event loop."""

    def __init__(self, log: Any, workers: int = 32) -> None:
        self.log = log
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aibro-proxy")
        self._lock = threading.Lock()
        self._target: config.Target | None = None
        self._local = threading.local()

    def warm_up(self) -> None:
        """Find or start the backend in the background, so the first sidebar request finds it ready."""
        self.pool.submit(self._safe_target)

    def _safe_target(self) -> None:
        try:
            self.target()
        except AibroError as exc:
            self.log.warning("aibro_jupyter: %s", exc)

    def target(self) -> config.Target:
        with self._lock:
            if self._target is None:
                self._target = config.resolve(start=True)
            return self._target

    def _transport(self, target: config.Target) -> Transport:
        t = getattr(self._local, "transport", None)
        if t is None or t.url != target.url.rstrip("/") or t.token != target.token:
            t = Transport(target.url, target.token)
            self._local.transport = t
        return t

    def forward(self, method: str, path: str, params: dict[str, str], timeout: float) -> requests.Response:
        """One call to the backend. If it is gone the call fails (the sidebar says "reconnecting") and the next
        call finds it again, starting the embedded backend anew if that is the one that went away."""
        target = self.target()
        try:
            return self._transport(target).send(method, path, params=params, timeout=timeout)
        except BackendUnreachable:
            self.log.info("aibro_jupyter: backend at %s unreachable; the next call looks for it again", target.url)
            with self._lock:
                if self._target is target:
                    self._target = None
            raise
