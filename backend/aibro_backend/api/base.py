"""Shared request handling: bearer-token auth, JSON bodies and JSON errors."""

from __future__ import annotations

import json
from typing import Any

import tornado.web

from ..state import Backend


class ApiError(tornado.web.HTTPError):
    """An error whose message is shown to the user as it is."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, reason=None)
        self.message = message


class BaseHandler(tornado.web.RequestHandler):
    backend: Backend

    def initialize(self, backend: Backend) -> None:
        self.backend = backend

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def bearer(self) -> str:
        auth = self.request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            raise ApiError(401, "this route needs a token: send 'Authorization: Bearer TOKEN'")
        return auth[7:].strip()

    def body_json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    def send(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "message", None) or self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message, "status": status_code}))


class UserHandler(BaseHandler):
    """Routes for users: the token maps to one user, and every query is scoped to that user."""

    user: dict[str, Any]

    def prepare(self) -> None:
        user = self.backend.store.user_for_token(self.bearer())
        if user is None:
            raise ApiError(401, "the token is not valid for this backend: check AIBRO_TOKEN or run `aibro login`")
        self.user = user

    @property
    def uid(self) -> int:
        return int(self.user["id"])

    def own_job(self, job_id: str) -> dict[str, Any]:
        job = self.backend.store.job(job_id, self.uid)
        if job is None:
            raise ApiError(404, f"no job '{job_id[:80]}' for this user: `aibro jobs` lists yours")
        return job
