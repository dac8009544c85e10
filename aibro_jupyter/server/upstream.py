"""The backend the server extension talks to: found (or started) once, found again after it goes away, and called
through tornado's AsyncHTTPClient, so a long-poll waiting in the backend holds a socket, never a thread.

Long-polls go to the event port the backend announces in /health, as the client's do (the backend answers them
there for a fifth of the CPU); when that port cannot be reached they go to the main port, which decides whether
the backend is there at all, and the event port is asked for again a minute later."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.httputil import HTTPInputError
from tornado.simple_httpclient import HTTPTimeoutError, SimpleAsyncHTTPClient

from aibro_core.transport import (
    EVENT_PORT_CONNECT_S,
    EVENT_PORT_RECHECK_S,
    ca_bundle,
    event_port_url,
    may_have_event_port,
    ssl_context,
    untrusted_message,
)

from .. import config
from ..errors import AibroError

CONNECT_TIMEOUT_S = 5.0
QUICK_TIMEOUT_S = 30.0
LONG_POLL_SLACK_S = 15.0
# Sockets open at once. Long-polls get their own client, so a call that answers at once never queues behind them.
MAX_QUICK = 32
MAX_LONG_POLLS = 256
MAX_BODY_BYTES = 64 * 1024 * 1024


class Unreachable(Exception):
    """The backend did not answer. `message` is for the browser and names no URL, port or token; `detail` is for
    the Jupyter server's log."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class Upstream:
    """Forwards calls to the backend on Jupyter's own event loop, any number at once."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._target: config.Target | None = None
        self._finding: asyncio.Lock | None = None
        self._quick: AsyncHTTPClient | None = None
        self._polls: AsyncHTTPClient | None = None
        self._search: asyncio.Future[None] | None = None
        self._tls: tuple[str | None, ssl.SSLContext] | None = None  # (CA bundle, its context), made once
        # (the backend it belongs to, when learned, the event port's URL or None)
        self._events: tuple[config.Target, float, str | None] | None = None

    async def warm_up(self) -> None:
        """Find or start the backend as soon as Jupyter's loop runs, so the first sidebar request finds it ready."""
        try:
            await self.target()
        except Unreachable as exc:
            self.log.warning("aibro_jupyter: %s", exc.detail)

    async def target(self) -> config.Target:
        """The configured backend, else the embedded one, started if it is not running. `config.resolve` reads
        files and may wait for a daemon to start, so it runs on a worker thread, one search at a time."""
        if self._finding is None:
            self._finding = asyncio.Lock()
        async with self._finding:
            if self._target is None:
                try:
                    self._target = await asyncio.get_running_loop().run_in_executor(None, config.resolve)
                except AibroError as exc:
                    message = "the aibro backend could not be found or started; the Jupyter server log says why"
                    raise Unreachable(message, str(exc)) from None
            return self._target

    def _client(self, long_poll: bool) -> AsyncHTTPClient:
        # Made on first use, inside the running loop; force_instance keeps them apart from the shared client
        # (whose default of 10 sockets would queue everything behind ten long-polls).
        if self._quick is None or self._polls is None:
            limits = {"force_instance": True, "max_body_size": MAX_BODY_BYTES}
            self._quick = SimpleAsyncHTTPClient(max_clients=MAX_QUICK, **limits)
            self._polls = SimpleAsyncHTTPClient(max_clients=MAX_LONG_POLLS, **limits)
        return self._polls if long_poll else self._quick

    def _ssl_options(self, target: config.Target) -> ssl.SSLContext | None:
        """How an HTTPS backend is verified: the one transport's rule (its CA bundle, else the system's roots)."""
        if not target.url.startswith("https:"):
            return None
        try:
            bundle = ca_bundle(target.ca_bundle)
        except AibroError as exc:
            raise Unreachable(
                "the aibro backend's CA bundle cannot be read (the Jupyter server log names it)", str(exc)
            ) from None
        if self._tls is None or self._tls[0] != bundle:
            self._tls = (bundle, ssl_context(bundle))
        return self._tls[1]

    async def forward(self, method: str, path: str, query: dict[str, str], wait: float) -> Answer:
        """One call to the backend, whatever status it answers. If the backend cannot be reached the call raises
        `Unreachable` (the sidebar says "reconnecting") and the next call looks for it again, starting the
        embedded backend anew if that is the one that went away. A long-poll (`wait` > 0) goes to the event port
        when the backend has one this server reaches."""
        target = await self.target()
        if wait > 0:
            base = await self._event_port(target)
            if base is not None:
                try:
                    return await self._fetch(target, base, method, path, query, wait, EVENT_PORT_CONNECT_S)
                except Unreachable as exc:
                    self.log.info("aibro_jupyter: long-polls go to the main port: %s", exc.detail)
                    self._events = (target, time.monotonic(), None)
        try:
            return await self._fetch(target, target.url, method, path, query, wait, CONNECT_TIMEOUT_S)
        except Unreachable:
            self._forget(target)
            raise

    async def _fetch(
        self,
        target: config.Target,
        base: str,
        method: str,
        path: str,
        query: dict[str, str],
        wait: float,
        connect_timeout: float,
    ) -> Answer:
        url = f"{base.rstrip('/')}/api/v1{path}" + (f"?{urlencode(query)}" if query else "")
        request = HTTPRequest(
            url,
            method=method,
            headers={"Authorization": f"Bearer {target.token}", "Accept": "application/json"},
            body=b"" if method == "POST" else None,
            connect_timeout=connect_timeout,
            request_timeout=wait + LONG_POLL_SLACK_S if wait > 0 else QUICK_TIMEOUT_S,
            follow_redirects=False,
            ssl_options=self._ssl_options(target),
        )
        try:
            response: HTTPResponse = await self._client(wait > 0).fetch(request, raise_error=False)
        except HTTPInputError as exc:  # an answer over MAX_BODY_BYTES, or not HTTP at all
            message = "the aibro backend's answer was too large or malformed"
            raise Unreachable(message, f"{method} {base}/api/v1{path} failed: {exc!r}") from None
        except ssl.SSLCertVerificationError as exc:
            message = "the aibro backend's TLS certificate is not trusted: give its CA bundle (see the server log)"
            raise Unreachable(message, untrusted_message(target.url, exc.verify_message, target.ca_bundle)) from None
        except (OSError, HTTPClientError) as exc:  # refused, reset, or a timeout (HTTPTimeoutError, 599)
            if isinstance(exc, HTTPTimeoutError):
                message = "the aibro backend did not answer in time; retrying"
            elif target.embedded:
                message = "the aibro backend is not reachable; it is being restarted"
                if base == target.url:  # the main port: the backend itself is gone, not only its event port
                    self._search_soon()
            else:
                message = "the aibro backend is not reachable; retrying (the Jupyter server log names it)"
            raise Unreachable(message, f"{method} {base}/api/v1{path} failed: {exc!r}") from None
        return Answer(response.code, response.body or b"")

    async def _event_port(self, target: config.Target) -> str | None:
        """The event port's URL from the backend's /health, learned once per backend and again a while after it
        failed (client.BackendClient._event_port does the same for kernels)."""
        now = time.monotonic()
        if self._events is not None and self._events[0] is target:
            if self._events[2] is not None or now - self._events[1] < EVENT_PORT_RECHECK_S:
                return self._events[2]
        url = None
        if may_have_event_port(target.url):
            try:
                answer = await self._fetch(target, target.url, "GET", "/health", {}, 0.0, CONNECT_TIMEOUT_S)
                health = json.loads(answer.body) if answer.status == 200 else {}
                url = event_port_url(target.url, health.get("events_port") if isinstance(health, dict) else None)
            except (Unreachable, ValueError):
                url = None
        self._events = (target, now, url)
        return url

    def _search_soon(self) -> None:
        """Start the search now rather than on the next call, so "it is being restarted" is true."""
        if self._search is None or self._search.done():
            self._search = asyncio.ensure_future(self.warm_up())

    def _forget(self, target: config.Target) -> None:
        """The next search resolves the backend again (`config.resolve` starts a new embedded one if it died)."""
        if self._target is target:
            self._target = None
