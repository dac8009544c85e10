"""An S3 endpoint that misbehaves for a while: a small HTTP proxy on 127.0.0.1 in front of moto's server, through which
the backend (AWS_ENDPOINT_URL_S3), and so every presigned URL it signs for kernels and workers, reaches the bucket.
Between faults it forwards each request as it came and each answer as it went; while a fault is on, a share of the
requests meet what S3 does on a bad day:

* ``500``: 500 InternalError ("We encountered an internal error. Please try again.");
* ``503``: 503 ServiceUnavailable;
* ``slowdown``: 503 SlowDown ("Please reduce your request rate.");
* ``drop``: the connection closed without an answer: after the request's head, halfway through its body, or
  after S3 did the work (halfway through the answer's body, or before an answer with none): a reset, not a clean
  close;
* ``slow``: the answer held back for `slow_s` seconds, then given.

Which requests a fault hits is drawn from the proxy's own seeded generator; `hits` counts them by kind, `served`
every request that went through whole. No EC2, SSM or IAM call passes here: those keep moto's own endpoint."""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

KINDS = ("500", "503", "slowdown", "drop", "slow")
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
}
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}


class FlakyS3:
    def __init__(self, upstream: str, seed: int = 0, slow_s: float = 8.0) -> None:
        split = urlsplit(upstream)
        self.upstream = (split.hostname or "127.0.0.1", split.port or 80)
        self.rng = random.Random(seed)
        self.slow_s = slow_s
        self.hits: Counter[str] = Counter()
        self.served = 0
        self._fault: tuple[tuple[str, ...], float, float, tuple[str, ...]] | None = None  # kinds, share, until, methods
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return None

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any  # noqa: N815 - http.server's names

            def finish(self) -> None:
                try:
                    super().finish()
                except (OSError, ValueError):
                    pass  # a connection this proxy dropped on purpose

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # type: ignore[method-assign] - a client gone is no news
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="flaky-s3", daemon=True)

    def __enter__(self) -> FlakyS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the faults ------------------------------------------------------------------------------------
    def fault(
        self, kind: str | tuple[str, ...], seconds: float, share: float = 1.0, methods: tuple[str, ...] = ()
    ) -> None:
        """From now on, for `seconds`, a `share` of the requests (of these HTTP `methods` only, when given) meet
        `kind` (one of KINDS; of several, one drawn for each request)."""
        kinds = (kind,) if isinstance(kind, str) else tuple(kind)
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"{kind!r} is not one of {KINDS}")
        with self._lock:
            self._fault = (kinds, share, time.monotonic() + seconds, methods)

    def clear(self) -> None:
        with self._lock:
            self._fault = None

    def _draw(self, method: str) -> str | None:
        with self._lock:
            if self._fault is None:
                return None
            kinds, share, until, methods = self._fault
            if time.monotonic() >= until:
                self._fault = None
                return None
            if (methods and method not in methods) or self.rng.random() >= share:
                return None
            kind = self.rng.choice(kinds)
            self.hits[kind] += 1
            return kind

    # -- one request ---------------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        kind = self._draw(h.command)
        length = int(h.headers.get("Content-Length") or 0)
        chunked = "chunked" in (h.headers.get("Transfer-Encoding") or "").lower()
        if kind == "drop":
            where = self.rng.choice(["head", "body", "answer"] if length or chunked else ["head", "answer"])
            if where == "head":
                return _reset(h)
            if where == "body":
                h.rfile.read(length // 2 if length else 1)
                return _reset(h)
        body = _read_chunked(h) if chunked else h.rfile.read(length) if length else b""
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            text = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            text += f"<RequestId>flaky-{self.hits[kind]}</RequestId></Error>"
            return _answer(h, status, {"Content-Type": "application/xml"}, text.encode(), h.command != "HEAD")
        if kind == "slow":
            time.sleep(self.slow_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if chunked:
            headers["Content-Length"] = str(len(body))
            headers.pop("x-amz-decoded-content-length", None)
        conn = http.client.HTTPConnection(*self.upstream, timeout=300)
        try:
            conn.request(h.command, h.path, body=body if (length or chunked) else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP}
        except OSError:
            return _reset(h)  # moto itself failed to answer: the client sees a broken connection
        finally:
            conn.close()
        if kind == "drop":  # S3 did the work; its answer is lost: halfway through its body, or whole if it has none
            if data and h.command != "HEAD":
                out["Content-Length"] = str(len(data))
                _head(h, resp.status, out)
                h.wfile.write(data[: len(data) // 2])
                h.wfile.flush()
            return _reset(h)
        with self._lock:
            self.served += 1
        _answer(h, resp.status, out, data, h.command != "HEAD")


def _read_chunked(h: BaseHTTPRequestHandler) -> bytes:
    out = bytearray()
    while True:
        size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        out += h.rfile.read(size)
        h.rfile.readline()


def _head(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str]) -> None:
    h.send_response_only(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.end_headers()


def _answer(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, send_body: bool) -> None:
    if "content-length" not in {k.lower() for k in headers}:
        headers = {**headers, "Content-Length": str(len(body))}
    _head(h, status, headers)
    if send_body:
        h.wfile.write(body)
    h.wfile.flush()


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Close the client's connection with a reset, as a dropped connection reaches it."""
    h.close_connection = True
    try:
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        h.connection.close()
    except OSError:
        pass
