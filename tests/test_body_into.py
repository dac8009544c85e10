"""Upload bodies read into the receiving handler's own buffers (server/bodyinto.py), on a real tornado server over
a real socket: every byte arrives, in order, through `body_filled` (none through `data_received`); a handler that
lends no buffers, and one whose request was refused, get the body tornado's way."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import tornado.netutil
import tornado.web
from tornado.ioloop import IOLoop

from aibro_backend.server.bodyinto import BodyInto, _target
from aibro_backend.server.listener import GuardedHTTPServer

pytestmark = pytest.mark.fast


@tornado.web.stream_request_body
class Lending(tornado.web.RequestHandler):
    def prepare(self) -> None:
        self.digest, self.filled, self.received = hashlib.sha256(), 0, 0
        self.buf = bytearray(64 * 1024)

    def body_buffer(self) -> memoryview:
        return memoryview(self.buf)

    def body_filled(self, buf: memoryview, n: int) -> None:
        assert buf.obj is self.buf
        self.digest.update(buf[:n])
        self.filled += 1

    def data_received(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.received += 1

    def put(self) -> None:
        self.finish({"sha256": self.digest.hexdigest(), "filled": self.filled, "received": self.received})


@tornado.web.stream_request_body
class Plain(tornado.web.RequestHandler):
    def prepare(self) -> None:
        self.digest, self.received = hashlib.sha256(), 0

    def data_received(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.received += 1

    def put(self) -> None:
        self.finish({"sha256": self.digest.hexdigest(), "received": self.received})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    ready = threading.Event()
    where: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        app = tornado.web.Application([(r"/lend", Lending), (r"/plain", Plain)])
        http = GuardedHTTPServer(app, max_connections=16, chunk_size=1 << 20)
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        http.add_sockets(sockets)
        where["url"] = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        where["loop"] = IOLoop.current()
        ready.set()
        IOLoop.current().start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    yield where["url"]
    where["loop"].add_callback(where["loop"].stop)
    thread.join(timeout=30)


def test_a_lending_handler_gets_every_byte_in_its_own_buffers(server: str) -> None:
    body = os.urandom(5 * 1024 * 1024 + 123)
    with requests.Session() as s:
        for _ in range(2):  # and again on the same connection
            got = s.put(f"{server}/lend", data=body).json()
            assert got["sha256"] == hashlib.sha256(body).hexdigest()
            assert got["received"] == 0 and got["filled"] >= len(body) // (64 * 1024)


def test_a_handler_that_lends_nothing_gets_the_body_as_tornado_gives_it(server: str) -> None:
    body = os.urandom(3 * 1024 * 1024)
    got = requests.put(f"{server}/plain", data=body).json()
    assert got["sha256"] == hashlib.sha256(body).hexdigest() and got["received"] >= 3


def test_the_chain_is_followed_to_the_handler_and_stops_at_a_refusal() -> None:
    class Node:
        def __init__(self, **links: Any) -> None:
            self.__dict__.update(links)

    handler = Lending.__new__(Lending)
    assert isinstance(handler, BodyInto)
    assert _target(Node(delegate=Node(inner=Node(handler=handler), refused=False))) is handler
    assert _target(Node(delegate=Node(inner=Node(handler=handler), refused=True))) is None
    assert _target(Node(delegate=Node(inner=Node(handler=Plain.__new__(Plain))))) is None
