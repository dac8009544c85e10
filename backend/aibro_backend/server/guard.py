"""The request guard: a request is answered from its headers alone when its token is missing, unknown or
expired, or its Content-Length is over the route's limit (1 MiB for JSON, 64 MiB for one streamed upload chunk),
so no body of a stranger is ever buffered; each body must arrive within a deadline (limits.py has the numbers)."""

from __future__ import annotations

import json
import logging
from email.utils import formatdate
from typing import Any

import tornado.httpserver
import tornado.web
from tornado import httputil

from aibro_core.compat import tornado as tornado_compat

from ..api import worker
from ..api.base import NO_TOKEN, ApiError, UserHandler, bearer_of, user_token
from .accesslog import log_tornado
from .limits import Limits
from .state import Backend

log = logging.getLogger("aibro.backend")


LINGER_MAX = 64 * 1024  # a refused body up to this size is read and dropped, so the client can read the answer
# ... and up to this size when the client's token holds and only the body's size is refused (413): a client that
# sends its whole body before it reads (most do) then reads the 413 instead of meeting a reset connection
DRAIN_MAX = 64 * 1024 * 1024


# -- the request guard: token and size from the headers, before any body is read -----------------------------------
def _body_limit(handler_class: type, limits: Limits) -> int:
    """The route's body limit: a handler names its Limits field in BODY_LIMIT; worker event batches get theirs."""
    if handler_class is getattr(worker, "WorkerEventsHandler", None):
        return limits.events_max_body
    return int(getattr(limits, getattr(handler_class, "BODY_LIMIT", "json_max_body")))


def _bearer(headers: httputil.HTTPHeaders) -> str | None:
    return bearer_of(headers.get("Authorization"))


def header_refusal(
    backend: Backend, handler_class: type, request: httputil.HTTPServerRequest
) -> tuple[int, str] | None:
    """Why this request is answered from its headers alone, or None. Also sets its body deadline and size cap."""
    limits = backend.limits
    limit = _body_limit(handler_class, limits)
    streamed = tornado_compat.streams_request_body(handler_class)
    conn = request.connection
    raw = request.headers.get("Content-Length")
    length = int(raw) if raw is not None and raw.strip().isdigit() else None
    if conn is not None:
        conn.set_max_body_size(limit)  # also bounds a chunked (Transfer-Encoding) body as it arrives
        extra = (length or 0) / limits.min_body_rate if streamed else 0.0
        conn.set_body_timeout(limits.body_timeout_s + extra)
    if issubclass(handler_class, (worker.WorkerHandler, UserHandler)):
        token = _bearer(request.headers)
        if token is None:
            return 401, NO_TOKEN
        if issubclass(handler_class, worker.WorkerHandler):
            inst = backend.store.instances.for_token(token)
            if inst is None:
                return 401, "unknown worker token"
            request.aibro_instance = inst  # type: ignore[attr-defined]  # WorkerHandler.prepare: one lookup a request
        else:
            try:
                request.aibro_token = user_token(backend.store, token)  # type: ignore[attr-defined]  # for prepare
            except ApiError as exc:
                return exc.status_code, exc.message
    if raw is not None and length is None:
        return 400, f"Content-Length {raw[:40]!r} is not a whole number of bytes"
    if length is not None and length > limit:
        how = " per request: send it in chunks with ?offset=&total= (the client does)" if streamed else ""
        return 413, f"the request body of {length} bytes is over this route's limit of {limit} bytes{how}"
    return None


class _Guard(httputil.HTTPMessageDelegate):
    """Wraps a handler's delegate: a refused request is answered at once and its body is never handed on (one
    that `_drained_length` allows is read and dropped so the client sees the answer, any other closes the
    connection)."""

    def __init__(
        self, inner: httputil.HTTPMessageDelegate, request: httputil.HTTPServerRequest, check: Any, limits: Limits
    ) -> None:
        self.inner, self.request, self.check, self.limits = inner, request, check, limits
        self.refused = False

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> Any:
        refusal = self.check()
        if refusal is None:
            return self.inner.headers_received(start_line, headers)
        self.refused = True
        status, message = refusal
        conn = self.request.connection
        assert conn is not None
        body = json.dumps({"error": message, "status": status}).encode()
        length = self._drained_length(status)
        out = httputil.HTTPHeaders(
            {
                "Content-Type": "application/json",
                "Cache-Control": "no-store",
                "Content-Length": str(len(body)),
                "Date": formatdate(usegmt=True),
            }
        )
        if length is None:
            out["Connection"] = "close"
        head = self.request.method == "HEAD"
        conn.write_headers(
            httputil.ResponseStartLine("HTTP/1.1", status, httputil.responses.get(status, "")),
            out,
            None if head else body,
        )
        log_tornado(status, self.request, "refused from its headers")
        if length is not None:
            conn.set_max_body_size(length)
            conn.set_body_timeout(self.limits.linger_s + length / self.limits.min_body_rate)
        else:  # closes the connection once the answer is out: the body is never read (nor refused again as too long)
            conn.set_max_body_size(1 << 62)
            conn.finish()
        return None

    def _drained_length(self, status: int) -> int | None:
        """The length of a refused body that is read and dropped before the connection goes on, or None when the
        connection is closed instead: a chunked body, or one too large to read for nothing (a stranger's over
        LINGER_MAX, a known client's over DRAIN_MAX)."""
        raw = self.request.headers.get("Content-Length", "0").strip()
        if not raw.isdigit() or "Transfer-Encoding" in self.request.headers:
            return None
        length = int(raw)
        return length if length <= (DRAIN_MAX if status == 413 else LINGER_MAX) else None

    def data_received(self, chunk: bytes) -> Any:
        return None if self.refused else self.inner.data_received(chunk)

    def finish(self) -> None:
        if self.refused:
            assert self.request.connection is not None
            self.request.connection.finish()
        else:
            self.inner.finish()

    def on_connection_close(self) -> None:
        if not self.refused:
            self.inner.on_connection_close()


class GuardedApplication(tornado.web.Application):
    def get_handler_delegate(
        self,
        request: httputil.HTTPServerRequest,
        target_class: type[tornado.web.RequestHandler],
        target_kwargs: dict[str, Any] | None = None,
        path_args: list[bytes] | None = None,
        path_kwargs: dict[str, bytes] | None = None,
    ) -> Any:
        inner = super().get_handler_delegate(request, target_class, target_kwargs, path_args, path_kwargs)
        backend = (target_kwargs or {}).get("backend")
        if backend is None:
            return inner
        return _Guard(inner, request, lambda: header_refusal(backend, target_class, request), backend.limits)
