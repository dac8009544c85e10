"""The Jupyter server extension: installed enabled, `/aibro/api/*` behind Jupyter's auth, an allow-list of the
user API, the backend token never handed out, and the embedded backend started (and restarted) on demand."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
from backend_proc import own_backend
from browser import jupyterlab

from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import kill_workers, make_model


def _backend(home: Path) -> tuple[int, str, str]:
    info = json.loads((home / "backend.json").read_text())
    token = json.loads((home / "credentials.json").read_text())["token"]
    return int(info["pid"]), info["url"], token


def _wait_backend(home: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (home / "backend.json").exists():
        assert time.monotonic() < deadline, "the server extension did not start the embedded backend"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fresh_lab(tmp_path_factory: pytest.TempPathFactory):
    """JupyterLab with an AIBRO_HOME where no backend runs yet."""
    root = tmp_path_factory.mktemp("lab-root")
    home = tmp_path_factory.mktemp("fresh-aibro-home")
    with jupyterlab(root, {"AIBRO_HOME": str(home)}, root / "lab.log") as (url, token):
        yield url, token, home, root
    try:
        os.kill(_backend(home)[0], signal.SIGTERM)
    except (OSError, ValueError):
        pass
    kill_workers(home)


def test_installed_enabled_and_starts_the_embedded_backend(fresh_lab) -> None:  # noqa: ANN001
    url, token, home, root = fresh_lab
    _wait_backend(home)
    r = requests.get(f"{url}/aibro/api/machines", headers={"Authorization": f"token {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "local-cpu" in [m["machine_id"] for m in r.json()["machines"]]
    assert "aibro_jupyter: /aibro/api/* proxies the aibro backend" in (root / "lab.log").read_text()


def test_jupyter_auth_guards_every_route_and_only_the_user_api_passes(fresh_lab) -> None:  # noqa: ANN001
    url, token, home, _ = fresh_lab
    auth = {"Authorization": f"token {token}"}
    for path in ("jobs", "events?after=0", "instances", "machines"):
        assert requests.get(f"{url}/aibro/api/{path}", timeout=30).status_code == 403, path
    assert requests.post(f"{url}/aibro/api/jobs/job-x/cancel", timeout=30).status_code == 403
    _, backend_url, backend_token = _backend(home)
    wrong = {"Authorization": f"Bearer {backend_token}"}  # the backend's token is no Jupyter credential
    assert requests.get(f"{url}/aibro/api/jobs", headers=wrong, timeout=30).status_code == 403
    for method, path in [
        ("GET", "worker/assignment"),
        ("GET", "auth/tokens"),
        ("GET", "jobs/job-x/artifacts/model.keras"),
        ("POST", "jobs"),
        ("GET", "blobs/" + "0" * 64),
        ("GET", "jobs/job-x/events/more"),
        ("GET", "jobs/job%2F..%2Fworker/events"),
    ]:
        r = requests.request(method, f"{url}/aibro/api/{path}", headers=auth, timeout=30)
        assert r.status_code == 404, (method, path, r.status_code)
    r = requests.get(f"{url}/aibro/api/jobs/job-nope", headers=auth, timeout=30)
    assert r.status_code == 404 and "job-nope" in r.json()["error"], "backend errors pass through as they were"


def _connections_to(port: int) -> int:
    """Open TCP connections to 127.0.0.1:port, as this host's kernel lists them."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            n += fields[2].endswith(f":{port:04X}") and fields[3] == "01"  # remote port, ESTABLISHED
    return n


def test_health_answers_at_once_while_forty_long_polls_wait(fresh_lab) -> None:  # noqa: ANN001
    """Long-polls hold a socket each, never a thread: /aibro/api/health answers while 40 of them wait in the
    backend (a 32-thread pool made it wait behind them). They wait on the event port the backend announces, as
    a kernel's do (the backend answers them there for a fifth of the CPU)."""
    url, token, home, _ = fresh_lab
    _wait_backend(home)
    auth = {"Authorization": f"token {token}"}
    cursor = requests.get(f"{url}/aibro/api/jobs", headers=auth, timeout=30).json()["cursor"]  # no job runs yet
    backend_port = requests.get(f"{url}/aibro/api/health", headers=auth, timeout=30).json()["events_port"]
    polls, wait = 40, 15

    def long_poll() -> requests.Response:
        return requests.get(f"{url}/aibro/api/events", params={"after": cursor, "wait": wait}, headers=auth, timeout=60)

    with ThreadPoolExecutor(polls) as pool:
        started = time.monotonic()
        waiting = [pool.submit(long_poll) for _ in range(polls)]
        while (held := _connections_to(backend_port)) < polls:
            assert time.monotonic() - started < wait - 3, f"only {held} of {polls} long-polls reached the backend"
            time.sleep(0.1)
        t0 = time.monotonic()
        health = requests.get(f"{url}/aibro/api/health", headers=auth, timeout=30)
        took = time.monotonic() - t0
        pending = sum(not f.done() for f in waiting)
        answers = [f.result() for f in waiting]
    elapsed = time.monotonic() - started
    assert health.status_code == 200 and health.json()["ok"] is True, health.text
    assert pending == polls, f"only {pending} of {polls} long-polls were still waiting when health answered"
    assert took < wait, f"/aibro/api/health took {took:.1f} s behind {polls} long-polls"
    assert all(a.status_code == 200 and a.json()["events"] == [] for a in answers), [a.text for a in answers][:3]
    assert wait <= elapsed < 2 * wait, f"the long-polls waited side by side, not in turns ({elapsed:.1f} s)"


def test_bad_event_query_values_get_400_from_the_proxy(fresh_lab) -> None:  # noqa: ANN001
    url, token, _, _ = fresh_lab
    auth = {"Authorization": f"token {token}"}
    # A job the backend does not know would answer 404: 400 says the proxy refused the value first.
    for path in ("events", "jobs/job-nope/events", "jobs"):
        for query, name in BAD_QUERIES:
            r = requests.get(f"{url}/aibro/api/{path}?{query}", headers=auth, timeout=30)
            assert r.status_code == 400, (path, query, r.status_code, r.text)
            assert f"'{name}' must be" in r.json()["error"], (path, query, r.text)


BAD_QUERIES = [
    ("wait=nan", "wait"),
    ("wait=NaN", "wait"),
    ("wait=inf", "wait"),
    ("wait=-1", "wait"),
    ("wait=1e400", "wait"),
    ("wait=abc", "wait"),
    ("wait=", "wait"),
    ("after=abc", "after"),
    ("after=-1", "after"),
    ("after=1.5", "after"),
    ("after=99999999999999999999", "after"),
    ("after=" + "9" * 5000, "after"),
    ("after=", "after"),
]


@pytest.fixture(scope="module")
def dead_backend_lab(tmp_path_factory: pytest.TempPathFactory):
    """JupyterLab whose configured backend (AIBRO_BACKEND_URL) listens nowhere."""
    root = tmp_path_factory.mktemp("dead-lab-root")
    home = tmp_path_factory.mktemp("dead-aibro-home")
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend_url, backend_token = f"http://127.0.0.1:{port}", "aibro_u_" + secrets.token_hex(16)
    env = {"AIBRO_HOME": str(home), "AIBRO_BACKEND_URL": backend_url, "AIBRO_TOKEN": backend_token}
    with jupyterlab(root, env, root / "lab.log") as (url, token):
        yield url, token, backend_url, backend_token, root / "lab.log"


def test_502_names_no_backend_url_or_token(dead_backend_lab) -> None:  # noqa: ANN001
    url, token, backend_url, backend_token, log = dead_backend_lab
    auth = {"Authorization": f"token {token}"}
    port = str(urlsplit(backend_url).port)
    for path in ("jobs", "health", "events?after=0&wait=5", "jobs/job-x/events?wait=1"):
        t0 = time.monotonic()
        r = requests.get(f"{url}/aibro/api/{path}", headers=auth, timeout=60)
        assert r.status_code == 502 and r.json()["reconnecting"] is True, (path, r.status_code, r.text)
        assert "not reachable" in r.json()["error"], r.text
        for secret in (backend_url, "127.0.0.1", port, backend_token):
            assert secret not in r.text, f"the 502 for {path} shows {secret!r}: {r.text}"
        assert time.monotonic() - t0 < 15, f"a refused connection took {time.monotonic() - t0:.1f} s to say so"
    r = requests.post(f"{url}/aibro/api/jobs/job-x/cancel", headers=auth, timeout=60)
    assert r.status_code == 502 and backend_url not in r.text and port not in r.text, r.text
    assert backend_url in log.read_text(), "the Jupyter server log names the backend it cannot reach"
    assert backend_token not in log.read_text()
    for query, _ in BAD_QUERIES:  # refused before any call to the (dead) backend
        assert requests.get(f"{url}/aibro/api/events?{query}", headers=auth, timeout=30).status_code == 400, query


def test_proxy_follows_jobs_cancels_and_never_leaks_the_token(fresh_lab, digits, tmp_path: Path) -> None:  # noqa: ANN001
    url, token, home, _ = fresh_lab
    _wait_backend(home)
    _, backend_url, backend_token = _backend(home)
    auth = {"Authorization": f"token {token}"}
    client = BackendClient(backend_url, backend_token)
    x, y, _, _ = digits
    from aibro_jupyter.training import Training

    job = Training(client).submit(
        FitRequest(
            make_model(), np.repeat(x, 8, axis=0), np.repeat(y, 8, axis=0), "local-cpu", epochs=30, description="proxy"
        )
    )
    listed = requests.get(f"{url}/aibro/api/jobs", headers=auth, timeout=30).json()
    assert [j["job_id"] for j in listed["jobs"]] == [j.job_id for j in client.jobs()]
    assert listed["cursor"] >= 1

    deadline, seen = time.monotonic() + 180, []
    after = 0
    while not any(e["type"] == "epoch" for e in seen):
        assert time.monotonic() < deadline, "no epoch event reached the proxy's long-poll"
        r = requests.get(f"{url}/aibro/api/events", params={"after": after, "wait": 10}, headers=auth, timeout=40)
        assert r.status_code == 200, r.text
        seen += r.json()["events"]
        after = r.json()["cursor"]
    assert {e["job_id"] for e in seen} == {job.job_id}

    r = requests.post(f"{url}/aibro/api/jobs/{job.job_id}/cancel", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while client.job(job.job_id).status != "CANCELED":
        assert time.monotonic() < deadline
        time.sleep(0.5)

    bodies = [
        requests.get(f"{url}/aibro/api/{p}", headers=auth, timeout=30).text
        for p in ("jobs", "events?after=0", "instances", "machines", "health", "policy", f"jobs/{job.job_id}")
    ]
    bodies.append(requests.get(f"{url}/lab?token={token}", timeout=30).text)  # the page and its page config
    assert all(backend_token not in b for b in bodies), "the backend token reached the browser"


def test_backend_killed_the_proxy_finds_a_new_one(fresh_lab) -> None:  # noqa: ANN001
    url, token, home, _ = fresh_lab
    _wait_backend(home)
    pid, _, _ = _backend(home)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    auth = {"Authorization": f"token {token}"}
    _, backend_url, backend_token = _backend(home)
    r = requests.get(f"{url}/aibro/api/jobs", headers=auth, timeout=90)
    assert r.status_code == 502 and r.json()["reconnecting"] is True, "the browser hears that the backend is gone"
    assert "being restarted" in r.json()["error"], r.text
    for secret in (backend_url, str(urlsplit(backend_url).port), backend_token):
        assert secret not in r.text, f"the 502 shows {secret!r}: {r.text}"
    deadline = time.monotonic() + 60
    while (r := requests.get(f"{url}/aibro/api/jobs", headers=auth, timeout=90)).status_code != 200:
        assert r.status_code == 502 and time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert _backend(home)[0] != pid, "a new embedded backend serves the proxy"
    assert "proxy" in [j["description"] for j in r.json()["jobs"]], "its state survived (SQLite under AIBRO_HOME)"


def test_the_proxy_long_polls_the_event_port_and_falls_back_to_the_main_port(tmp_path: Path) -> None:
    """The extension's upstream, in-process against a real backend: a long-poll waits on the event port /health
    announces; when that port does not answer (gone after a restart, firewalled) the same long-poll is answered
    by the main port, and the next ones go there too instead of trying the dead port each time."""
    import asyncio
    import logging

    from aibro_jupyter.config import Target
    from aibro_jupyter.server.upstream import Upstream

    with own_backend(tmp_path / "home") as b:
        client = b.client()
        events_port, main_port = client.health().events_port, urlsplit(b.url).port
        cursor = client.user_events()["cursor"]
        upstream = Upstream(logging.getLogger("test"))
        upstream._target = target = Target(b.url, b.token, embedded=False)
        query = {"after": str(cursor), "wait": "4"}

        async def poll_and_count(port: int) -> tuple[int, int, int]:
            """The long-poll's status, events, and the connections it opened to `port` while it waited."""
            before = _connections_to(port)  # the test's own client keeps one open to each port
            waiting = asyncio.ensure_future(upstream.forward("GET", "/events", query, 4.0))
            held = before
            for _ in range(30):
                await asyncio.sleep(0.1)
                held = max(held, _connections_to(port))
            answer = await waiting
            return answer.status, len(json.loads(answer.body)["events"]), held - before

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]

        async def check() -> None:  # one event loop, as in the Jupyter server
            assert await poll_and_count(events_port) == (200, 0, 1)
            upstream._events = (target, time.monotonic(), f"http://127.0.0.1:{dead}")
            assert await poll_and_count(main_port) == (200, 0, 1)
            assert upstream._events[2] is None, "a dead event port is not tried again at once"
            assert await poll_and_count(main_port) == (200, 0, 1)

        asyncio.run(check())
