"""Issue 14 item 3: the event port. A backend answers event long-polls on a second, lean listener as well
(backend/aibro_backend/api/eventport.py): /health announces it, the client sends its long-polls there, and every
answer is the main port's answer, byte for byte, under the same token rules and user scoping. Anything else there
is refused with where to go; bad HTTP is refused and the connection closed; its connections count under the one
cap and idle ones close; with it turned off, or unreachable, long-polls use the main port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from backend_proc import own_backend

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import answered_again, slow_data, wait_for


def _get(url: str, token: str | None, **kw: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.get(url, headers=headers, timeout=90, **kw)


def _raw(port: int, data: bytes, wait_s: float = 10.0) -> bytes:
    """What the event port sends back to `data` before it closes the connection (or `wait_s` passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        got = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
        return got


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A backend with one finished two-epoch job of its first user, and a second user."""
    with own_backend(tmp_path_factory.mktemp("evport") / "home") as b:
        client = b.client()
        x, y = slow_data(300)
        job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, batch_size=32))
        wait_for(
            client,
            job.job_id,
            lambda evs: any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs),
            timeout=600,
        )
        port = client.health().events_port
        yield {"backend": b, "job_id": job.job_id, "port": port, "other": b.add_user("eve")}


def test_health_announces_the_port_and_its_answers_are_the_main_ports_byte_for_byte(trained: dict) -> None:
    b, job_id, port = trained["backend"], trained["job_id"], trained["port"]
    assert isinstance(port, int) and port != int(b.url.rsplit(":", 1)[1])
    fast, main = f"http://127.0.0.1:{port}/api/v1", f"{b.url}/api/v1"
    for path in (f"/jobs/{job_id}/events?after=0", f"/jobs/{job_id}/events?after=3", "/events?after=0", "/events"):
        there, here = _get(fast + path, b.token), _get(main + path, b.token)
        assert (there.status_code, there.content) == (here.status_code, here.content), path
        assert there.headers["Content-Type"] == "application/json" and there.headers["Cache-Control"] == "no-store"
    page = _get(f"{fast}/jobs/{job_id}/events?after=0", b.token).json()
    assert page["status"] == v.COMPLETED and [e["data"]["epoch"] for e in page["events"] if e["type"] == "epoch"] == [
        0,
        1,
    ]


def test_another_user_sees_neither_the_job_nor_its_events_there(trained: dict) -> None:
    b, job_id, port = trained["backend"], trained["job_id"], trained["port"]
    eve: BackendClient = trained["other"]
    fast = f"http://127.0.0.1:{port}/api/v1"
    theirs = _get(f"{fast}/jobs/{job_id}/events?after=0", eve.t.token)
    assert theirs.status_code == 404 and "no job" in theirs.json()["error"]
    assert _get(f"{fast}/events?after=0", eve.t.token).json()["events"] == []
    assert _get(f"{fast}/events?after=0", b.token).json()["events"]


@pytest.mark.backend_log(r"401 GET /api/v1/events")
def test_refusals_name_the_problem_like_the_main_port(trained: dict) -> None:
    b, port = trained["backend"], trained["port"]
    fast, main = f"http://127.0.0.1:{port}/api/v1", f"{b.url}/api/v1"
    for path, token in (
        ("/events?after=-1", b.token),
        ("/events?wait=soon", b.token),
        ("/events?wait=inf", b.token),
        ("/events", None),
        ("/events", "aibro_u_not-a-real-token"),
        ("/jobs/nobody/events", b.token),
    ):
        there, here = _get(fast + path, token), _get(main + path, token)
        assert there.status_code == here.status_code and there.status_code in (400, 401, 404), path
        assert there.json()["error"] == here.json()["error"], path

    elsewhere = _get(f"{fast}/health", b.token)
    assert elsewhere.status_code == 404 and b.url in elsewhere.json()["error"]
    posted = requests.post(f"{fast}/events", headers={"Authorization": f"Bearer {b.token}"}, timeout=30)
    assert posted.status_code == 405 and posted.headers["Allow"] == "GET"
    with_body = requests.get(f"{fast}/events", headers={"Authorization": f"Bearer {b.token}"}, data=b"{}", timeout=30)
    assert with_body.status_code == 400 and "no request body" in with_body.json()["error"]

    garbage = _raw(port, b"NOT HTTP AT ALL\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in garbage
    huge = _raw(port, b"GET /api/v1/events HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert huge.startswith(b"HTTP/1.1 431 ") and b"over 65536 bytes" in huge
    assert b.client().health().ok


def test_pipelined_requests_are_answered_in_order_and_keep_alive_holds(trained: dict) -> None:
    b, job_id, port = trained["backend"], trained["job_id"], trained["port"]
    ask = f"GET /api/v1/jobs/{job_id}/events?after=%d HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {b.token}\r\n\r\n"
    last = (ask.replace("HTTP/1.1\r\n", "HTTP/1.1\r\nConnection: close\r\n")) % 2
    got = _raw(port, "".join(ask % n for n in (0, 1)).encode() + last.encode())
    answers = [
        json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1 ")[0]) for part in got.split(b"HTTP/1.1 200")[1:]
    ]
    assert [a["events"][0]["seq"] for a in answers] == [1, 2, 3]


def test_a_long_poll_there_wakes_when_an_event_lands(trained: dict) -> None:
    b, port = trained["backend"], trained["port"]
    client = b.client()
    cursor = client.user_events()["cursor"]
    got: dict[str, Any] = {}

    def poll() -> None:
        t0 = time.monotonic()
        got["page"] = _get(f"http://127.0.0.1:{port}/api/v1/events?after={cursor}&wait=50", b.token).json()
        got["s"] = time.monotonic() - t0

    waiter = threading.Thread(target=poll)
    waiter.start()
    time.sleep(1.0)
    x, y = slow_data(100)
    job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, batch_size=32))
    waiter.join(60)
    assert got["page"]["events"] and got["page"]["events"][0]["job_id"] == job.job_id
    assert got["s"] < 45, "the long-poll ran out instead of waking"
    client.cancel(job.job_id)


def test_the_client_long_polls_the_event_port_and_falls_back_to_the_main_port(trained: dict) -> None:
    b, job_id, port = trained["backend"], trained["job_id"], trained["port"]
    client = b.client()
    sent: list[str] = []
    real = client.t.session.request

    def spy(method: str, url: str, **kw: Any) -> Any:
        sent.append(url)
        return real(method, url, **kw)

    client.t.session.request = spy  # type: ignore[method-assign]
    events = list(client.follow(job_id))
    assert [e["data"]["epoch"] for e in events if e["type"] == "epoch"] == [0, 1]
    polls = [u for u in sent if "/events" in u]
    assert polls and all(u.startswith(f"http://127.0.0.1:{port}/") for u in polls), sent

    with socket.socket() as s:  # a port nobody listens on: the announced one is gone (a restart, a firewall)
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    client._event_base = (time.monotonic(), f"http://127.0.0.1:{dead}")
    sent.clear()
    assert client.events(job_id, 0)["status"] == v.COMPLETED
    assert sent[-1].startswith(f"{b.url}/"), sent
    sent.clear()
    client.events(job_id, 0)
    assert all(u.startswith(f"{b.url}/") for u in sent), "a failed event port was tried again at once"


def test_turned_off_the_backend_announces_none_and_long_polls_use_the_main_port(tmp_path: Path) -> None:
    with own_backend(tmp_path / "home", AIBRO_EVENTS_PORT="off") as b:
        client = b.client()
        assert "events_port" not in client.health()
        assert client.user_events()["events"] == []
        assert client._event_base == (client._event_base[0], None)


def test_its_connections_count_under_the_cap_and_idle_ones_close(tmp_path: Path) -> None:
    with own_backend(tmp_path / "home", AIBRO_MAX_CONNECTIONS="12", AIBRO_IDLE_TIMEOUT_S="3") as b:
        port = b.client().health().events_port
        time.sleep(0.5)  # the health call's connection closes with its client
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        try:
            time.sleep(0.5)
            turned = _raw(port, b"")  # turned away at accept: the answer comes before any request
            assert turned.startswith(b"HTTP/1.1 503 ") and b"limit of 12 connections" in turned
            main = _raw(int(b.url.rsplit(":", 1)[1]), b"")
            assert main.startswith(b"HTTP/1.1 503 "), "the cap is not shared by both ports"
            for s in held:
                s.settimeout(10)
                assert s.recv(1) == b"", "an idle connection was not closed"
        finally:
            for s in held:
                s.close()
        assert answered_again(lambda: b.client().user_events())["events"] == []
