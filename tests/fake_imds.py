"""A tiny fake of the EC2 instance metadata service (IMDSv2) for spot-interruption tests: a session token is
required (PUT /latest/api/token), `spot/instance-action` and the rebalance recommendation answer 404 until the
test flips them with `announce()` / `recommend_rebalance()`, or (`notice_when`) the notice comes by itself once a
condition holds, checked on each read: no test thread in between, so a loaded box cannot make it late."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aibro_backend.worker.spot import INSTANCE_ACTION, REBALANCE, TOKEN_PATH


class FakeImds:
    def __init__(self, notice_when: Callable[[], bool] | None = None) -> None:
        self.notice_when = notice_when
        self.tokens: set[str] = set()
        self.answers: dict[str, str] = {}
        self.reads: list[str] = []  # paths read with a valid token
        self.refused = 0  # reads without a valid token
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_PUT(self) -> None:
                if self.path != TOKEN_PATH or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._answer(400, "")
                    return
                token = secrets.token_urlsafe(16)
                fake.tokens.add(token)
                self._answer(200, token)

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                    fake.refused += 1
                    self._answer(401, "")
                    return
                fake.reads.append(self.path)
                if self.path == INSTANCE_ACTION and fake.notice_when is not None and fake.notice_when():
                    fake.notice_when = None
                    fake.announce()
                body = fake.answers.get(self.path)
                self._answer(200, body) if body is not None else self._answer(404, "Not Found")

            def _answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeImds:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def announce(self, action: str = "terminate", time: str = "2026-11-23T18:00:00Z") -> None:
        """AWS's two-minute notice: from now on `spot/instance-action` answers it."""
        self.answers[INSTANCE_ACTION] = json.dumps({"action": action, "time": time})

    def recommend_rebalance(self, time: str = "2026-11-23T17:50:00Z") -> None:
        self.answers[REBALANCE] = json.dumps({"noticeTime": time})

    def expire_tokens(self) -> None:
        self.tokens.clear()
