"""A sandboxed job has no network but the backend (issue 24 item 2), replayed from the user's side: a custom layer
tries a port another program holds on 127.0.0.1, the backend's event port and the internet, takes the backend's
port number, and still reaches the backend. The package index is reached through the backend's proxy, only while
pip builds an environment; the proxy lets nothing else through."""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import pytest
from netprobe_layer import NetProbe

from aibro_backend.providers import jobnet
from aibro_backend.worker.netbridge import Bridge
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import slow_data


def test_a_sandboxed_job_reaches_the_backend_and_nothing_else(client: BackendClient, aibro_home: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: the README's test command installs it (apt-get install bubblewrap)")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    info = json.loads((aibro_home / "backend.json").read_text())
    targets = {"host_listener": listener.getsockname()[1], "events_port": info["events_port"] or info["port"]}
    inner = make_model()
    model = keras.Sequential([keras.Input((64,)), NetProbe(targets), *inner.layers])
    model.compile("adam", "sparse_categorical_crossentropy")
    x, y = slow_data(500)
    trainer = Training(client)
    job = trainer.submit(
        FitRequest(model, x, y, machine_ids="local-cpu", epochs=1, batch_size=64, cool_down_period_s=600)
    )
    view = trainer.watch(job.job_id)
    assert view.status == "COMPLETED", view.errors  # the worker talked to the backend the whole time
    report = aibro_home / "state" / "workers" / client.job(job.job_id).instance_id / "netprobe.json"
    assert report.exists(), "the layer ran on the worker and wrote its report"
    found = json.loads(report.read_text())
    assert found["host_listener"] == "ConnectionRefusedError", found
    assert found["events_port"] == "ConnectionRefusedError", found
    assert found["internet"] in ("gaierror", "OSError", "ConnectionRefusedError", "TimeoutError"), found
    assert found["backend_port"] in ("BOUND", "OSError"), found  # in its own namespace either way, never the host's
    assert found["backend"] == "401", found  # the backend itself answered (and wants a token)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody came
    assert client.health().sandbox == "bwrap"  # the backend's port on this host is still the backend's


class _Index(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = f"index page {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    """A package proxy on a Unix socket that allows one local 'index'; a second local server it must not reach."""
    index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    for server in (index, other):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    path = tmp_path / jobnet.PACKAGES_SOCK
    proxy = jobnet.PackageProxy({f"127.0.0.1:{index.server_port}"})
    asyncio.run_coroutine_threadsafe(proxy.start(path), loop).result(30)
    yield path, index.server_port, other.server_port

    async def stop() -> None:
        proxy.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.sleep(0.1)  # the canceled connections end

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    index.shutdown()
    other.shutdown()


def _ask(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        sock.sendall(request)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


@pytest.mark.fast
def test_the_package_proxy_reaches_only_the_index(proxy: tuple[Path, int, int]) -> None:
    path, index, other = proxy
    got = _ask(path, f"GET http://127.0.0.1:{index}/simple/x/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.0 200") and got.endswith(b"index page /simple/x/"), got
    refused = _ask(path, f"CONNECT 127.0.0.1:{other} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert refused.startswith(b"HTTP/1.1 403") and b"AIBRO_JOB_PACKAGE_HOSTS" in refused, refused
    refused = _ask(path, f"GET http://127.0.0.1:{other}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert refused.startswith(b"HTTP/1.1 403"), refused


@pytest.mark.fast
def test_connect_tunnels_to_an_allowed_host(proxy: tuple[Path, int, int]) -> None:
    path, index, _ = proxy
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        sock.sendall(f"CONNECT 127.0.0.1:{index} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /tunnelled HTTP/1.0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.endswith(b"index page /tunnelled"), answer


@pytest.mark.fast
def test_the_bridge_pipes_a_loopback_port_to_a_unix_socket(proxy: tuple[Path, int, int]) -> None:
    path, index, _ = proxy
    bridge = Bridge(path)
    try:
        with socket.create_connection(("127.0.0.1", bridge.port)) as sock:
            sock.sendall(f"GET http://127.0.0.1:{index}/bridged HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = b""
            while data := sock.recv(65536):
                answer += data
    finally:
        bridge.close()
    assert answer.endswith(b"index page /bridged"), answer


@pytest.mark.fast
def test_package_hosts_come_from_pips_settings(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = https://mirror.example:8443/simple file:///opt/x\n")
    env = {
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": str(conf),
        "PIP_INDEX_URL": "http://index.example/simple",
        "AIBRO_JOB_PACKAGE_HOSTS": "wheels.example, cache.example:8080",
    }
    hosts = jobnet.package_hosts(env)
    assert {"pypi.org:443", "files.pythonhosted.org:443", "mirror.example:8443", "index.example:80"} <= hosts
    assert {"wheels.example:443", "cache.example:8080"} <= hosts
    assert not any("/" in h for h in hosts)  # file:// indexes and local folders need no network
    with pytest.raises(ValueError, match="AIBRO_JOB_NETWORK"):
        jobnet.isolated("bwrap", {"AIBRO_JOB_NETWORK": "open"})
    assert jobnet.isolated("bwrap", {}) and not jobnet.isolated("bwrap", {"AIBRO_JOB_NETWORK": "host"})
    assert not jobnet.isolated("none", {})


@pytest.mark.fast
def test_a_job_that_fails_for_want_of_a_network_is_told_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from aibro_backend.worker import netbridge

    try:
        try:
            socket.getaddrinfo("pypi.org.invalid", 443)
        except socket.gaierror as exc:
            raise RuntimeError("could not download the weights") from exc
    except RuntimeError as exc:
        failure = exc
    assert netbridge.explain(failure) == "", "a worker with the host's network says nothing more"
    monkeypatch.setenv(netbridge.BRIDGE_ENV, "/run/aibro")
    assert "no network but the backend" in netbridge.explain(failure)
    assert "AIBRO_JOB_NETWORK=host" in netbridge.explain(failure)
    assert netbridge.explain(ValueError("bad shape")) == ""


def test_a_proxy_connection_open_when_the_backend_stops_logs_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The backend stops (its loop cancels every task) while a worker's connection to the package proxy waits:
    nothing reaches the log as an error."""

    async def main() -> None:
        proxy = jobnet.PackageProxy({"pypi.org:443"})
        await proxy.start(tmp_path / "p.sock")
        _reader, writer = await asyncio.open_unix_connection(str(tmp_path / "p.sock"))
        writer.write(b"CONNECT pypi.org:443 HTTP/1.1\r\n")  # half a request head: the proxy waits for the rest
        await writer.drain()
        while not any(t.get_coro().__qualname__ == "PackageProxy._serve" for t in asyncio.all_tasks()):
            await asyncio.sleep(0)
        proxy.close()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())  # returns with the proxy's handler still waiting: asyncio.run cancels it
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
