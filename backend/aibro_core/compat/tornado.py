"""tornado internals (checked with tornado 6.6.1; see tests/test_compat.py and tests/try_newest.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


def connection_handler(server: Any) -> Any:
    """The callback `TCPServer.add_sockets` gives each accepted connection (`TCPServer._handle_connection`): the
    backend's own accept loop (server/listener.py) hands connections to it, and `add_accept_handler`, the public
    way, offers neither a connection cap nor a pause at the descriptor limit."""
    return server._handle_connection


def open_connections(server: Any) -> list[Any]:
    """The HTTP connections an `HTTPServer` has open (`HTTPServer._connections`): only `close_all_connections`
    reads them publicly, and the backend closes those whose answer stopped moving."""
    return list(server._connections)


def bytes_written(stream: Any) -> int | None:
    """How many bytes an `IOStream` has written to its socket so far (`BaseIOStream._total_write_done_index`), or
    None: the public `writing()` says only whether a write is pending, not whether it moves."""
    return getattr(stream, "_total_write_done_index", None)


def streams_request_body(handler_class: type) -> bool:
    """Whether a `RequestHandler` class takes its body as it arrives (`@tornado.web.stream_request_body` sets
    `RequestHandler._stream_request_body`; tornado reads it with a private function too)."""
    return bool(getattr(handler_class, "_stream_request_body", False))


def status_reason(handler: Any) -> str:
    """The reason phrase of a `RequestHandler`'s status (`RequestHandler._reason`: the one `set_status` was given
    or the standard one); `get_status()` has only the code."""
    return handler._reason


# -- upload bodies read into the handler's buffers (aibro_backend/server/bodyinto.py) --------------------------------
def replace_fixed_body_reader(conn: Any, read: Callable[[int, Any], Awaitable[None]]) -> bool:
    """Make `read(content_length, delegate)` read this server connection's fixed-length request bodies, in place of
    tornado's `HTTP1Connection._read_fixed_body`; False (nothing changed) for any other connection.

    Why: tornado reads a body into a fresh buffer per socket read, copies it into the stream's buffer and slices
    a new bytes object per piece for `data_received` (`@stream_request_body`, the public way): the backend reads
    uploads straight into its writer's buffers instead. Kept because the public way misses the target of 0.8 of
    the disk's speed: `bench_upload.py --readers into,public` (benchmarks/README.md), both side by side in one run,
    2026-11-28 on the loaded 2-core box: 1.9 GiB, the public way 0.60 (array) and 0.38 (memmap) of the disk's
    0.15 GB/s against 1.01 and 0.81 this way, 3.30 backend CPU s per GiB against 1.97; 1 GiB, 0.84 and 0.54
    against 1.13 and 1.02, 2.52 CPU s per GiB against 1.63. Checked with tornado 6.6.1."""
    from tornado import http1connection

    if not isinstance(conn, http1connection.HTTP1Connection):
        return False
    conn._read_fixed_body = read
    return True


async def read_fixed_body_as_tornado(conn: Any, content_length: int, delegate: Any) -> None:
    """tornado's own reader of a fixed-length body (`HTTP1Connection._read_fixed_body`), for the bodies a
    replacement leaves to it."""
    from tornado import http1connection

    await http1connection.HTTP1Connection._read_fixed_body(conn, content_length, delegate)


async def deliver_body(conn: Any, delegate: Any, piece: bytes) -> None:
    """Hand one piece of a body to the request's delegate as tornado's reader does (`HTTP1Connection._deliver_body`:
    `data_received`, then waiting for a coroutine it returns)."""
    await conn._deliver_body(delegate, piece)
