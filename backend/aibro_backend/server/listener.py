"""The main port's listener: caps open connections (the next gets a short 503), closes a connection whose answer
the client stopped taking, and pauses accepting for a moment when the process is out of descriptors instead of
spinning on accept()."""

from __future__ import annotations

import errno
import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import tornado.httpserver
import tornado.web
from tornado.ioloop import IOLoop, PeriodicCallback

from aibro_core.compat import tornado as tornado_compat

from ..settings import BackendSettings
from . import bodyinto
from .limits import Limits

log = logging.getLogger("aibro.backend")


FD_RESERVE = 256  # descriptors kept free of client connections: the database, logs, blob files, worker pipes
ACCEPT_PAUSE_S = 0.5


# -- the server: a cap on open connections, and an accept loop that pauses at the descriptor limit -----------------
class GuardedHTTPServer(tornado.httpserver.HTTPServer):
    def initialize(self, *args: Any, max_connections: int = 1000, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self.max_connections = max_connections
        self.open_connections = 0
        self.turned_away = 0
        self._stopped = False
        self._last_note = 0.0
        self._also: list[socket.socket] = []
        self._close_also: list[Callable[[], None]] = []

    def start_request(self, server_conn: object, request_conn: Any) -> Any:
        bodyinto.install(request_conn)  # uploads go from the socket into their writer's buffers
        return super().start_request(server_conn, request_conn)

    def add_sockets(self, sockets: Any) -> None:
        sockets = list(sockets)
        super().add_sockets(sockets)  # registers tornado's accept handler (which stop() removes) ...
        loop = IOLoop.current()
        for sock in sockets:  # ... replaced by ours, under the same registration
            loop.remove_handler(sock)
            loop.add_handler(sock, self._accept_handler(sock), IOLoop.READ)

    def accept_also(
        self, sock: socket.socket, handle: Callable[[socket.socket, Any], None], close_all: Callable[[], None]
    ) -> None:
        """Accept on another listening socket under the same cap, pause and turn-away, handing each connection to
        `handle(conn, address)` (the event port), which counts it in `open_connections` until it closes;
        `close_all()` closes its open connections at shutdown."""
        self._also.append(sock)
        self._close_also.append(close_all)
        IOLoop.current().add_handler(sock, self._accept_handler(sock, handle), IOLoop.READ)

    def _accept_handler(self, sock: socket.socket, handle: Callable[[socket.socket, Any], None] | None = None) -> Any:
        handle = handle or tornado_compat.connection_handler(self)

        def accept(fd: Any, events: int) -> None:
            for _ in range(128):  # tornado's batch: other work runs between batches
                if self._stopped:
                    return
                try:
                    conn, address = sock.accept()
                except BlockingIOError:
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self._pause(sock, accept, exc)
                        return
                    raise
                if self.open_connections >= self.max_connections:
                    self._turn_away(conn)
                    continue
                handle(conn, address)

        return accept

    def _pause(self, sock: socket.socket, accept: Any, exc: OSError) -> None:
        """Out of descriptors: stop accepting for a moment (the waiting connections stay in the backlog) rather than
        retrying accept() in a loop; one log line per 10 s at most."""
        loop = IOLoop.current()
        loop.remove_handler(sock)
        self._note(
            f"accept() failed ({exc.strerror}) with {self.open_connections} connections open: pausing "
            f"{ACCEPT_PAUSE_S} s; raise the descriptor limit (ulimit -n) or lower AIBRO_MAX_CONNECTIONS"
        )

        def resume() -> None:
            if not self._stopped and sock.fileno() != -1:
                loop.add_handler(sock, accept, IOLoop.READ)

        loop.call_later(ACCEPT_PAUSE_S, resume)

    def _turn_away(self, conn: socket.socket) -> None:
        body = json.dumps(
            {
                "error": f"the backend is serving its limit of {self.max_connections} connections: retry shortly",
                "status": 503,
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            conn.setblocking(False)
            conn.send(head + body)
        except OSError:
            pass
        finally:
            conn.close()
        self.turned_away += 1
        self._note(f"at the cap of {self.max_connections} open connections: turned away {self.turned_away} so far")

    def _note(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_note >= 10.0:
            self._last_note = now
            log.warning("%s", message)

    def handle_stream(self, stream: Any, address: Any) -> None:
        self.open_connections += 1
        super().handle_stream(stream, address)

    def watch_writes(self, stall_s: float) -> PeriodicCallback:
        """Close each connection whose answer has not moved for `stall_s`: tornado times out reading a request,
        never writing an answer, so a client that stops reading would hold its connection (and the answer) for
        good. Progress is the stream's count of bytes written, sampled every few seconds."""
        seen: dict[Any, tuple[int, float]] = {}

        def check() -> None:
            now = time.monotonic()
            for conn in tornado_compat.open_connections(self):
                stream = conn.stream
                done = tornado_compat.bytes_written(stream)
                if done is None or not stream.writing():
                    seen.pop(conn, None)
                    continue
                since = seen.get(conn)
                if since is None or since[0] != done:
                    seen[conn] = (done, now)
                elif now - since[1] >= stall_s:
                    del seen[conn]
                    stream.close()
            still_open = set(tornado_compat.open_connections(self))
            for conn in [c for c in seen if c not in still_open]:
                del seen[conn]

        watch = PeriodicCallback(check, 1000 * min(5.0, max(0.5, stall_s / 4)))
        watch.start()
        return watch

    def on_close(self, server_conn: Any) -> None:
        self.open_connections -= 1
        super().on_close(server_conn)

    def stop(self) -> None:
        self._stopped = True
        for sock in self._also:
            IOLoop.current().remove_handler(sock)
            sock.close()
        super().stop()

    async def close_everything(self) -> None:
        """Stop listening, then close every open connection (requests in flight finish first): a keep-alive
        connection would otherwise bring a request in after the store is closed."""
        self.stop()
        for close_all in self._close_also:
            close_all()
        await self.close_all_connections()


def raise_fd_limit() -> int:
    """Lift the soft descriptor limit to the hard one (at most 65536); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(limits: Limits, fd_soft: int) -> int:
    """The connection cap, kept FD_RESERVE below the descriptor limit unless AIBRO_MAX_CONNECTIONS says otherwise."""
    room = max(16, fd_soft - FD_RESERVE)
    if "max_connections" in BackendSettings.from_env().model_fields_set:
        if limits.max_connections > room:
            log.warning(
                "AIBRO_MAX_CONNECTIONS=%d is above the %d descriptors free for connections (ulimit -n %d)",
                limits.max_connections,
                room,
                fd_soft,
            )
        return limits.max_connections
    return min(limits.max_connections, room)
