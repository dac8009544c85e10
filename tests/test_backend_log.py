"""The backend's log says what needs acting on: a normal "not uploaded yet" HEAD is not a warning."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from backend_proc import own_backend

pytestmark = pytest.mark.fast


def test_a_missing_blob_head_is_not_a_warning_but_a_bad_token_is(tmp_path: Path) -> None:
    home = tmp_path / "quiet"
    with own_backend(home) as backend:
        client = backend.client()
        assert client.t.request("HEAD", "/blobs/" + "ab" * 32).status_code == 404
        with pytest.raises(Exception):  # noqa: B017 - any refusal; the log line is what is checked
            backend.client("aibro_u_not-a-token").health()
        log = backend.log
    text = log.read_text()
    assert "HEAD /api/v1/blobs/" not in text, "a normal 404 HEAD is logged at DEBUG, below the log's level"
    assert "401 GET /api/v1/health" in text and logging.getLevelName(logging.WARNING) in text, text[-2000:]


def test_long_polls_waiting_when_the_backend_stops_get_an_empty_answer_not_a_500(tmp_path: Path) -> None:
    """A clean stop answers every waiting long-poll (no events) before the loop ends; a handler still waiting then
    would be cancelled, and tornado answers a cancelled handler with a 500 that the log shows as an ERROR."""
    home = tmp_path / "stopping"
    answers: list[int] = []
    with own_backend(home) as backend:
        headers = {"Authorization": f"Bearer {backend.token}"}
        cursor = requests.get(f"{backend.url}/api/v1/events", headers=headers, timeout=30).json()["cursor"]

        def poll() -> None:
            url = f"{backend.url}/api/v1/events"
            answer = requests.get(url, params={"after": cursor, "wait": 60}, headers=headers, timeout=90)
            answers.append(answer.status_code)

        polls = [threading.Thread(target=poll) for _ in range(3)]
        for t in polls:
            t.start()
        deadline = time.monotonic() + 30
        while _established(backend.url) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _established(backend.url) >= 3, "the long-polls never reached the backend"
        backend.proc.send_signal(signal.SIGTERM)
        for t in polls:
            t.join(timeout=60)
        assert backend.proc.wait(timeout=60) == 0
    assert answers == [200, 200, 200], answers
    assert " 500 " not in backend.log.read_text()


def _established(url: str) -> int:
    """Connections open to the backend's port (from /proc/net/tcp): the long-polls are in."""
    port = int(url.rsplit(":", 1)[1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if int(parts[1].split(":")[1], 16) == port and parts[3] == "01":
            count += 1
    return count


def test_requests_on_open_connections_while_the_backend_stops_never_meet_a_closed_store(tmp_path: Path) -> None:
    """Keep-alive clients keep asking while a clean stop runs (workers and watchers do): the backend stops
    listening, closes every open connection (main port and event port), and only then closes its store, so no
    request is ever handled against a closed database (an ERROR traceback in the log) and it exits 0."""
    home = tmp_path / "closing"
    stop = threading.Event()
    answered: list[int] = []

    def ask(url: str) -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {backend.token}"
            while not stop.is_set():
                try:
                    answered.append(session.get(url, timeout=10).status_code)
                except requests.RequestException:
                    time.sleep(0.01)

    with own_backend(home) as backend:
        port = requests.get(
            f"{backend.url}/api/v1/health", headers={"Authorization": f"Bearer {backend.token}"}, timeout=30
        ).json()["events_port"]
        urls = [f"{backend.url}/api/v1/health"] * 2 + [f"http://127.0.0.1:{port}/api/v1/events?wait=0"] * 2
        askers = [threading.Thread(target=ask, args=(url,)) for url in urls]
        for t in askers:
            t.start()
        deadline = time.monotonic() + 30
        while len(answered) < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        backend.proc.send_signal(signal.SIGTERM)
        code = backend.proc.wait(timeout=60)
        stop.set()
        for t in askers:
            t.join(timeout=30)
        log = backend.log.read_text()
    assert len(answered) >= 200 and set(answered) == {200}, sorted(set(answered))
    assert code == 0
    assert "ERROR" not in log and "closed database" not in log, log[-3000:]
