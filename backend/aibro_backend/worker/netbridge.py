"""The worker's side of a sandbox without a network (providers/jobnet.py): its loopback address and port, where the
worker's URL points, lead to the backend's Unix socket; pip gets a proxy to the package index for as long as the
environment is built; where the bytes live in S3 the worker's HTTP goes through a proxy that reaches only the
backend and the bucket. Bytes are piped as they are, so TLS and tokens work end to end as over TCP."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

# the folder holding backend.sock and packages.sock, set by the local provider (WorkerSettings.worker_net_bridge; read
# here from the environment: this module runs alone, standard library only, where no aibro package is installed)
BRIDGE_ENV = "AIBRO_WORKER_NET_BRIDGE"
CHUNK = 1 << 20


def folder() -> Path | None:
    where = os.environ.get(BRIDGE_ENV)
    return Path(where) if where else None


class Bridge:
    """Listens on a loopback TCP address and pipes every connection to a Unix socket, on daemon threads."""

    def __init__(self, target: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = str(target)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(128)
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="aibro-bridge", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), name="aibro-bridge-conn", daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            out.connect(self.target)
        except OSError:
            conn.close()  # the backend is not there (yet): the client sees a closed connection and retries
            out.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=pump, args=(out, conn), name="aibro-bridge-conn", daemon=True)
        back.start()
        pump(conn, out)
        back.join()
        conn.close()
        out.close()


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy one direction of a connection until its end, then half-close the other side."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def to_backend(url: str) -> Bridge | None:
    """Where the worker has no network of its own: serve the worker URL's loopback port from the backend's socket."""
    where = folder()
    if where is None:
        return None
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    bridge = Bridge(where / "backend.sock", host, port)
    if (where / "storage.sock").exists():  # the bytes live in S3: this process's HTTP goes out through the backend
        proxy = f"http://127.0.0.1:{Bridge(where / 'storage.sock').port}"
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            os.environ[name] = proxy
        for name in ("NO_PROXY", "no_proxy"):
            os.environ.pop(name, None)
    return bridge


@contextlib.contextmanager
def package_proxy() -> Iterator[dict[str, str]]:
    """pip's proxy settings while the environment is built (none where the worker has the host's network); the
    way out closes again before the job's code runs."""
    where = folder()
    if where is None:
        yield {}
        return
    bridge = Bridge(where / "packages.sock")
    proxy = f"http://127.0.0.1:{bridge.port}"
    try:
        yield {"HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy, "NO_PROXY": ""}
    finally:
        bridge.close()


_NO_NETWORK = (errno.ENETUNREACH, errno.ECONNREFUSED, errno.EHOSTUNREACH)


def explain(exc: BaseException) -> str:
    """A hint to add to a job's error when its code failed to reach the network it does not have here."""
    if folder() is None:
        return ""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror) or (isinstance(seen, OSError) and seen.errno in _NO_NETWORK):
            return (
                " (sandboxed jobs on this backend have no network but the backend itself: download what the job "
                "needs in the notebook and pass it as data, or ask the backend's operator for AIBRO_JOB_NETWORK=host)"
            )
        seen = seen.__cause__ or seen.__context__
    return ""
