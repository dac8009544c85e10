"""Upload bodies read from the socket straight into the receiving writer's buffers.

tornado reads a body into a fresh buffer per socket read, appends it to the stream's buffer and slices a new bytes
object per piece: two copies and an allocation of every uploaded byte on the event loop, before the disk and the
hash see it. For a handler that lends buffers (`BodyInto`: the upload handlers of api/transfer.py), this connection
reads each piece with `IOStream.read_into` into a buffer the handler gives and hands it back filled; every other
body goes tornado's way. tornado has no public hook for this: the replacement of its reader, and the measurement
of the public `@stream_request_body` way that keeps it, are in aibro_core/compat/tornado.py."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from aibro_core.compat import tornado as tornado_compat

_LINKS = ("delegate", "inner", "handler")  # tornado's routing delegate -> our guard -> tornado's dispatcher


@runtime_checkable
class BodyInto(Protocol):
    """A request handler that takes its body in buffers of its own."""

    def body_buffer(self) -> memoryview | None:
        """Where the next bytes go, or None to take them as `data_received` (a refused body, dropped)."""

    def body_filled(self, buf: memoryview, n: int) -> None:
        """The first `n` bytes of `buf` (the last `body_buffer`) arrived."""


def _target(delegate: Any) -> BodyInto | None:
    """The handler behind a connection's delegate chain, when it lends buffers and its request was not refused."""
    node = delegate
    for _ in range(8):
        if node is None or getattr(node, "refused", False):
            return None
        if isinstance(node, BodyInto):
            return node
        node = next((getattr(node, link) for link in _LINKS if getattr(node, link, None) is not None), None)
    return None


async def read_body_into(conn: Any, content_length: int, delegate: Any) -> None:
    target = _target(delegate)
    if target is None:
        return await tornado_compat.read_fixed_body_as_tornado(conn, content_length, delegate)
    while content_length > 0:
        buf = target.body_buffer()
        if buf is None:
            piece = await conn.stream.read_bytes(min(conn.params.chunk_size, content_length), partial=True)
            content_length -= len(piece)
            await tornado_compat.deliver_body(conn, delegate, piece)
            continue
        n = await conn.stream.read_into(buf[: min(len(buf), content_length)], partial=True)
        content_length -= n
        target.body_filled(buf, n)
        await asyncio.sleep(0)  # other connections run between pieces, as tornado's own reader lets them


def install(conn: Any) -> None:
    """Read this connection's fixed-length bodies into lending handlers' buffers (a server connection only)."""

    async def read(content_length: int, delegate: Any) -> None:
        await read_body_into(conn, content_length, delegate)

    tornado_compat.replace_fixed_body_reader(conn, read)
