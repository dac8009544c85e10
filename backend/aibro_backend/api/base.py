"""Shared request handling: bearer-token auth, JSON bodies checked against declared models, and JSON errors."""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

import tornado.web
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

from aibro_core.compat import tornado as tornado_compat
from aibro_core.jsonout import dumps
from aibro_core.models import explain

from ..server.state import Backend
from ..storage.records import JobRecord

MAX_JSON_DEPTH = 32
M = TypeVar("M", bound=BaseModel)


class ApiError(tornado.web.HTTPError):
    """An error whose message is shown to the user as it is; `extra` fields join the error body."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(status, reason=None)
        self.message = message
        self.extra = extra


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number: send finite numbers only (or null)")


def parse_json(raw: bytes | str) -> Any:
    """JSON as the standard has it: NaN, Infinity and -Infinity are refused (Python's json accepts them), and so
    is anything nested deeper than MAX_JSON_DEPTH."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth_over(data, MAX_JSON_DEPTH):
        raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _depth_over(data: Any, limit: int) -> bool:
    """Whether parsed JSON nests deeper than `limit` levels, walked one level at a time over its containers only
    (a worker's batch of 50 events: 75 µs, where a stack of (node, depth) pairs took 125)."""
    level = [data]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node if type(node) is list else ())
            if type(child) is dict or type(child) is list
        ]
        if not level:
            return False
    return True


class BaseHandler(tornado.web.RequestHandler):
    backend: Backend

    def initialize(self, backend: Backend) -> None:
        self.backend = backend

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def compute_etag(self) -> str | None:
        """No ETag: every answer is no-store and no client sends If-None-Match, so hashing each body (tornado's
        default for a GET) is work for nothing, ~2 % of the backend's time under a team's load."""
        return None

    def bearer(self) -> str:
        auth = self.request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            raise ApiError(401, "this route needs a token: send 'Authorization: Bearer TOKEN'")
        return auth[7:].strip()

    def body_json(self) -> dict[str, Any]:
        try:
            data = parse_json(self.request.body or b"{}")
        except ValueError as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    def body_model(self, model: type[M], what: str = "the request body", data: Any = None) -> M:
        """The JSON body (or `data`) checked against `model`; 400 naming the first problem and its fix."""
        try:
            return model.model_validate(self.body_json() if data is None else data)
        except PydanticError as exc:
            raise ApiError(400, explain(exc, what)) from None

    def send(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "message", None) or tornado_compat.status_reason(self)
        if status_code == 405:
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.set_header("Content-Type", "application/json")
        self.finish(dumps({**getattr(exc, "extra", {}), "error": message, "status": status_code}))

    def allowed_methods(self) -> list[str]:
        """The methods this handler implements (what a 405's Allow header lists)."""
        base = tornado.web.RequestHandler
        return [
            m
            for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")
            if getattr(type(self), m.lower()) is not getattr(base, m.lower())
        ]


class UserHandler(BaseHandler):
    """Routes for users: the token maps to one user, and every query is scoped to that user."""

    user: dict[str, Any]

    def prepare(self) -> None:
        found = getattr(self.request, "aibro_token", None)  # looked up by guard.header_refusal
        if found is not None and not found["expired"]:
            user: dict[str, Any] | None = {"id": found["user_id"], "name": found["name"]}
        else:
            user = self.backend.store.tokens.user_for(self.bearer())
        if user is None:
            raise ApiError(401, "the token is not valid for this backend: check AIBRO_TOKEN or run `aibro login`")
        self.user = user

    @property
    def uid(self) -> int:
        return int(self.user["id"])

    def own_job(self, job_id: str) -> JobRecord:
        job = self.backend.store.jobs.get(job_id, self.uid)
        if job is None:
            raise not_yours(job_id)
        return job


NO_TOKEN = "this route needs a token: send 'Authorization: Bearer TOKEN'"


def bearer_of(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    auth = authorization or ""
    return auth[7:].strip() or None if auth.startswith("Bearer ") else None


def user_token(store: Any, token: str | None) -> dict[str, Any]:
    """The live user token's row (`Tokens.lookup`); a 401 naming what is wrong and the fix otherwise."""
    if token is None:
        raise ApiError(401, NO_TOKEN)
    found = store.tokens.lookup(token)
    if found is None:
        raise ApiError(401, "the token is not valid for this backend: check AIBRO_TOKEN or run `aibro login`")
    if found["expired"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(found["expires"]))
        raise ApiError(
            401,
            f"the token {found['id']} expired at {when}: log in with a live one (`aibro login URL`); "
            "a shared backend's admin mints one with `aibro backend add-user NAME`",
        )
    return found


def not_yours(job_id: str) -> ApiError:
    return ApiError(404, f"no job '{job_id[:80]}' for this user: `aibro jobs` lists yours")
