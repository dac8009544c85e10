"""The event port: a lean HTTP/1.1 listener that answers the event long-polls and nothing else.

Under a team's load most requests a backend answers are long-polls (each worker batch wakes every kernel,
sidebar and script watching its job or user), and tornado spends ~200 µs of CPU in its HTTP layer on each before
any of ours runs; this parser (httptools, the one uvicorn uses) and an asyncio protocol take ~20 µs
(benchmarks/README.md). Same host, same token rules, the same answers (api/longpoll.py), the same TLS context;
its connections count under the backend's one connection cap (listener.GuardedHTTPServer.accept_also), and idle ones
close after the same timeout, as do ones whose client stops taking its answers (no answer is queued behind one
that cannot be written, and one left unwritten for the idle timeout drops the connection). `/health` announces
its port; clients send long-polls there when they reach it and to the main port otherwise. Anything but `GET` of
those paths is answered with where to go instead."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote_plus

import httptools

from aibro_core import routes
from aibro_core.jsonout import dumps

from ..server.accesslog import log_access
from ..server.state import Backend
from . import longpoll
from .base import ApiError, bearer_of, user_token

log = logging.getLogger("aibro.backend")

MAX_HEAD = 64 * 1024  # request line and headers together (tornado's own default for the main port)
MAX_QUEUED = 16  # pipelined requests read ahead of the one being answered; reading pauses beyond it
MAX_PIPELINED = 64  # ... and dropped beyond this (one read can hold hundreds); no long-poll client pipelines
JOB_EVENTS = re.compile(routes.pattern("/jobs/{job_id}/events"))
STUDY_EVENTS = re.compile(routes.pattern("/studies/{study_id}/events"))
USER_EVENTS = re.compile(routes.pattern("/events"))
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}
REASONS.update({431: "Request Header Fields Too Large", 500: "Internal Server Error"})


@dataclass
class _Request:
    method: str
    url: bytes
    headers: dict[bytes, bytes]
    keep_alive: bool
    has_body: bool


class EventPort:
    """Listens beside the main port; `listen` binds it and returns the port number."""

    def __init__(self, backend: Backend, acceptor: Any, idle_timeout_s: float, tls: ssl.SSLContext | None) -> None:
        """`acceptor`: the main port's GuardedHTTPServer (its accept loop, cap and `open_connections`)."""
        self.backend, self.acceptor, self.idle_timeout_s, self.tls = backend, acceptor, idle_timeout_s, tls
        self._date = (0, "")
        self.connections: set[_Connection] = set()

    def listen(self, host: str, port: int = 0) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
        self.acceptor.accept_also(sock, self._accepted, self.close_connections)
        return int(sock.getsockname()[1])

    def _accepted(self, conn: socket.socket, address: Any) -> None:
        self.acceptor.open_connections += 1
        loop = asyncio.get_running_loop()
        peer = str(address[0]) if isinstance(address, tuple) else ""
        task = loop.create_task(
            loop.connect_accepted_socket(
                lambda: _Connection(self, peer),
                conn,
                ssl=self.tls,
                ssl_handshake_timeout=self.idle_timeout_s if self.tls else None,
            )
        )
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:  # a failed TLS handshake: no protocol ever ran
            self.acceptor.open_connections -= 1

    def closed(self, conn: _Connection) -> None:
        self.acceptor.open_connections -= 1
        self.connections.discard(conn)

    def close_connections(self) -> None:
        """At shutdown: every open connection closed (a long-poll waiting in one was answered by bus.close())."""
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()

    def date(self) -> str:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True))
        return self._date[1]

    async def answer(self, req: _Request) -> tuple[int, bytes, str]:
        """(status, JSON body, extra header lines) for one request."""
        path, _, query = req.url.partition(b"?")
        where = path.decode("latin-1")
        try:
            job = JOB_EVENTS.fullmatch(where)
            study = STUDY_EVENTS.fullmatch(where)
            if job is None and study is None and USER_EVENTS.fullmatch(where) is None:
                raise ApiError(
                    404,
                    "this port answers event long-polls only (GET /api/v1/jobs/ID/events, /api/v1/studies/ID/events, "
                    f"/api/v1/events): send {req.method} {where[:200]} to {self.backend.url}",
                )
            if req.method != "GET":
                return 405, _error(405, f"an event long-poll is a GET, not {req.method}"), "Allow: GET\r\n"
            if req.has_body:
                raise ApiError(400, "an event long-poll takes no request body")
            auth = req.headers.get(b"authorization")
            found = user_token(self.backend.store, bearer_of(auth.decode("latin-1") if auth is not None else None))
            after, wait = longpoll.after_wait(_query(query))
            uid = int(found["user_id"])
            if job is not None:
                return 200, await longpoll.job_events(self.backend, uid, job.group(1), after, wait), ""
            if study is not None:
                return 200, await longpoll.study_events(self.backend, uid, study.group(1), after, wait), ""
            return 200, await longpoll.user_events(self.backend, uid, after, wait), ""
        except ApiError as exc:
            return exc.status_code, _error(exc.status_code, exc.message, **exc.extra), ""
        except Exception:  # noqa: BLE001 - one request's bug is its 500, never the listener's end
            log.exception("event port: %s %s failed", req.method, where[:200])
            return 500, _error(500, "the backend failed on this request; its log says why"), ""


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as they arrive, answered one at a time in order."""

    def __init__(self, port: EventPort, peer: str) -> None:
        self.port, self.peer = port, peer
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.stall: asyncio.TimerHandle | None = None  # armed while the transport holds more than it can send
        self.paused = False
        self.writing_paused = False
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._head = 0
        self._body = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.port.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            too_big = isinstance(exc.__cause__ or exc.__context__, _HeadTooBig)
            self._refuse(431 if too_big else 400, _HeadTooBig.MESSAGE if too_big else f"malformed HTTP request: {exc}")
            return
        if len(self.queue) >= MAX_QUEUED and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()
        for timer in (self.idle, self.stall):
            if timer is not None:
                timer.cancel()
        self.queue.clear()
        self.port.closed(self)

    def pause_writing(self) -> None:
        """The client is not taking its answers: answer nothing more until it does, and drop the connection when
        it has not within the idle timeout (the answers would otherwise pile up in memory, and the connection stay
        open for good)."""
        self.writing_paused = True
        self._arm_stall()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.transport is None or self.transport.is_closing():
            return  # closing: what is left must still go within the timeout (_close)
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.task is None:
            self._go_on()

    def _arm_stall(self) -> None:
        if self.stall is None:
            self.stall = asyncio.get_running_loop().call_later(self.port.idle_timeout_s, self._stalled)

    def _stalled(self) -> None:
        self.stall = None
        if self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        """Close once what was written is sent (close() waits for it), dropping the connection when the client
        has not taken it within the idle timeout."""
        assert self.transport is not None
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._arm_stall()

    # -- httptools callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._head, self._body = b"", {}, 0, False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body = True

    def on_message_complete(self) -> None:
        if self.idle is not None:  # a whole request came within the idle timeout (counted from the last answer)
            self.idle.cancel()
            self.idle = None
        if self.transport is None or self.transport.is_closing():
            return
        if len(self.queue) >= MAX_PIPELINED:
            self.transport.abort()
            return
        method = self.parser.get_method().decode("latin-1")
        keep = self.parser.should_keep_alive()
        self.queue.append(_Request(method, self._url, self._headers, keep, self._body))
        if self.task is None and not self.writing_paused:
            self._next()

    def _count(self, n: int) -> None:
        self._head += n
        if self._head > MAX_HEAD:
            raise _HeadTooBig

    # -- answering ----------------------------------------------------------------------------------------------
    def _next(self) -> None:
        req = self.queue.popleft()
        self.task = asyncio.get_running_loop().create_task(self._serve(req))

    async def _serve(self, req: _Request) -> None:
        t0 = time.monotonic()
        status, body, extra = await self.port.answer(req)
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
            f"Cache-Control: no-store\r\nDate: {self.port.date()}\r\nContent-Length: {len(body)}\r\n{extra}"
            f"{'' if req.keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n"
        )
        transport.write(head.encode("latin-1") + body)
        path = req.url.partition(b"?")[0].decode("latin-1")[:200]
        log_access(status, req.method, path, self.peer, time.monotonic() - t0, "(event port)")
        self.task = None
        if not req.keep_alive:
            self._close()
        elif not self.writing_paused:  # else resume_writing goes on once the client takes what was written
            self._go_on()

    def _go_on(self) -> None:
        """After an answer is out: the next queued request, or reading again and waiting for one."""
        if self.queue:
            self._next()
            return
        if self.paused and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        self._arm_idle()

    def _refuse(self, status: int, message: str) -> None:
        """A request that cannot be parsed: answered and the connection closed (what follows cannot be framed)."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.task is not None:  # garbage pipelined behind a request still waiting: nothing here can be framed
            self._close()
            return
        body = _error(status, message)
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("latin-1") + body)
        log_access(status, "-", "-", self.peer, 0.0, "(event port: unparsable request)")
        self._close()

    def _arm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = asyncio.get_running_loop().call_later(self.port.idle_timeout_s, self._idle_out)

    def _idle_out(self) -> None:
        self.idle = None
        if self.task is None and self.transport is not None:
            self._close()


class _HeadTooBig(Exception):
    MESSAGE = f"the request line and headers are over {MAX_HEAD} bytes"


def _query(raw: bytes) -> dict[str, str]:
    """The query's arguments as tornado's `get_query_argument` gives them: the last value of each, decoded and
    stripped (parse_qs took a third of an answer's time for two plain numbers)."""
    out: dict[str, str] = {}
    for pair in raw.decode("latin-1").split("&"):
        name, _, value = pair.partition("=")
        if name:
            plain = "%" not in pair and "+" not in pair
            out[name if plain else unquote_plus(name)] = (value if plain else unquote_plus(value)).strip()
    return out


def _error(status: int, message: str, **extra: Any) -> bytes:
    return dumps({**extra, "error": message, "status": status}).encode()
