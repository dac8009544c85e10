"""What a sandboxed job reaches on the network: the backend, and the package index while its environment is built.

A sandboxed worker runs in a network namespace of its own (bubblewrap's `--unshare-net`): only its own loopback,
so a job cannot reach the Jupyter server, other services on 127.0.0.1, other users' traffic or the internet, and a
port it binds is not the host's. Two Unix sockets in one folder, bound read-only into the sandbox at `INSIDE`,
lead out of it:

* `backend.sock`: the backend's own HTTP server (the same routes, tokens, limits and TLS as its TCP port);
* `packages.sock`: a proxy that reaches only the package index's hosts (pypi.org and files.pythonhosted.org, the
  hosts of pip's index and find-links settings, and AIBRO_JOB_PACKAGE_HOSTS), used by pip while the job's
  environment is built, before the job's own code is loaded;
* `storage.sock`, only where the bytes live in S3: a proxy to the bucket's endpoint alone, which carries the
  worker's presigned downloads and uploads (a presigned URL reaches one object, for a while).

Inside, `worker/netbridge.py` listens on the worker's loopback address and port and pipes each connection to these
sockets. `AIBRO_JOB_NETWORK=host` gives sandboxed jobs the host's network again (the backend says so at start)."""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from ..settings import BackendSettings

log = logging.getLogger("aibro.jobnet")

INSIDE = "/run/aibro"
BACKEND_SOCK = "backend.sock"
PACKAGES_SOCK = "packages.sock"
STORAGE_SOCK = "storage.sock"  # only where the bytes live in S3: the bucket's endpoint, for presigned transfers
DEFAULT_PACKAGE_HOSTS = ("pypi.org:443", "files.pythonhosted.org:443")
BUFFER = 1 << 20  # a request's head must fit in it; bytes are piped in pieces of this size
CONNECT_TIMEOUT_S = 30.0
_PIP_URL_SETTINGS = ("index-url", "extra-index-url", "find-links")


def isolated(sandbox_kind: str, env: Mapping[str, str]) -> bool:
    """Whether sandboxed jobs get a network namespace of their own (the default wherever the sandbox works)."""
    return sandbox_kind == "bwrap" and _settings(env).job_network == "backend"


def _settings(env: Mapping[str, str]) -> BackendSettings:
    """The backend's settings in `env`. Imported here, not above: a Ray node's actor imports this module (through
    sandbox.py) and has no pydantic-settings."""
    from ..settings import BackendSettings

    return BackendSettings.from_env(env)


def socket_dir(state_dir: Path) -> Path:
    """The folder of the two sockets: traversable by the sandbox's uids (it sits in the backend's private state)."""
    path = Path(state_dir) / "run"
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o711)
    return path


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, connectable by the sandbox's uids; a stale one from an earlier start is
    replaced (workers that outlived it reconnect to the new one). Bound through /proc/self/fd so a long state path
    never meets the 108-byte limit of socket names."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        short = f"/proc/self/fd/{folder}/{path.name}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(short)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(short)
        os.chmod(short, 0o666)
    finally:
        os.close(folder)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def host_of(url: str) -> str:
    """`host:port` of an http(s) URL (a presigned one: what a worker must reach for its bytes)."""
    found = _host_port(url)
    if found is None:
        raise ValueError(f"not an http(s) URL: {url[:80]}")
    return found


def _host_port(url: str) -> str | None:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return f"{parts.hostname.lower()}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _pip_config_files(env: Mapping[str, str]) -> list[Path]:
    home = Path(env.get("HOME") or "~").expanduser()
    files = [Path("/etc/pip.conf"), Path("/etc/xdg/pip/pip.conf"), home / ".pip/pip.conf"]
    files.append(home / ".config/pip/pip.conf")
    if env.get("PIP_CONFIG_FILE"):
        files.append(Path(env["PIP_CONFIG_FILE"]))
    return files


def package_hosts(env: Mapping[str, str]) -> set[str]:
    """`host:port` names pip may reach from a sandbox: the public index, every http(s) index or find-links URL in
    pip's environment variables and configuration files, and AIBRO_JOB_PACKAGE_HOSTS (comma-separated)."""
    hosts = set(DEFAULT_PACKAGE_HOSTS)
    urls: list[str] = []
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        urls += (env.get(name) or "").split()
    for file in _pip_config_files(env):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(file)
        except (OSError, configparser.Error):
            continue
        for section in parser.sections():
            urls += [u for key in _PIP_URL_SETTINGS for u in parser.get(section, key, fallback="").split()]
    hosts |= {hp for hp in map(_host_port, urls) if hp}
    for item in _settings(env).job_package_hosts.split(","):
        item = item.strip().lower()
        if item:
            hosts.add(item if ":" in item else f"{item}:443")
    return hosts


class PackageProxy:
    """An HTTP proxy on a Unix socket that reaches only `allowed` (CONNECT for https, absolute-form requests for a
    plain-http index); anything else gets a 403 that names the setting to change."""

    def __init__(self, allowed: set[str], what: str = "the package index", fix: str = "") -> None:
        self.allowed, self.what = allowed, what
        self.fix = fix or ": if pip needs that host, add it to AIBRO_JOB_PACKAGE_HOSTS where the backend runs"
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: Path) -> None:
        self._server = await asyncio.start_unix_server(self._serve, sock=bind_unix(path), limit=BUFFER)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection; when the backend stops while it is open, it just closes: Python 3.11's streams log a
        handler that ends cancelled as an ERROR ("Exception in callback ... connection_made")."""
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT_S)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method == "CONNECT":
                where, first = target.lower(), b""
            else:
                where, first = self._origin_form(method, target, head)
            if where not in self.allowed:
                await self._refuse(writer, where)
                return
            host, port = where.rsplit(":", 1)
            upstream = asyncio.open_connection(host, int(port), limit=BUFFER)
            up_reader, up_writer = await asyncio.wait_for(upstream, CONNECT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
            writer.close()
            return
        except OSError as exc:
            with contextlib.suppress(OSError):
                writer.write(f"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\n\r\n{exc}".encode())
                await writer.drain()
            writer.close()
            return
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(first)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        writer.close()
        up_writer.close()

    @staticmethod
    def _origin_form(method: str, target: str, head: bytes) -> tuple[str, bytes]:
        parts = urlsplit(target)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(target)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [ln for ln in head.split(b"\r\n")[1:] if ln and not ln.lower().startswith((b"connection:", b"proxy-"))]
        request = [f"{method} {path} HTTP/1.1".encode(), *lines, b"Connection: close", b"", b""]
        return f"{parts.hostname.lower()}:{parts.port or 80}", b"\r\n".join(request)

    async def _refuse(self, writer: asyncio.StreamWriter, where: str) -> None:
        body = (f"a sandboxed job may reach only {self.what} here, not {where}{self.fix}\n").encode()
        writer.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUFFER):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()  # the other direction then ends too
