"""The `/aibro/api/*` routes: an allow-list of the backend's user API, behind Jupyter's authentication."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from aibro_core import routes

from .upstream import Unreachable, Upstream

ALLOWED = {
    method.upper(): [
        re.compile(routes.pattern(e.path, routes.BROWSER_CAPTURES, prefix="").lstrip("/"))
        for e in routes.ENDPOINTS
        if e.browser and e.method == method
    ]
    for method in ("get", "post")
}
# The query the event routes take, checked on every route so a bad value never reaches the backend.
EVENT_ROUTES = tuple(
    re.compile(routes.pattern(e.path, routes.BROWSER_CAPTURES, prefix="").lstrip("/"))
    for e in routes.ENDPOINTS
    if e.browser and e.events
)
MAX_AFTER = 2**63 - 1  # SQLite's INTEGER
MAX_WAIT_S = 60.0  # the backend waits no longer than this, whatever it is asked


class BadQuery(ValueError):
    pass


def event_query(get: Any) -> tuple[dict[str, str], float]:
    """`after` (an event cursor: a whole number) and `wait` (seconds, finite, >= 0; more than 60 waits 60), as the
    backend's EventsQuery declares them."""
    query: dict[str, str] = {}
    after = get("after", None)
    if after is not None:
        if not (after.isascii() and after.isdigit() and len(after) <= 19 and int(after) <= MAX_AFTER):
            raise BadQuery(f"'after' must be an event cursor, a whole number from 0 to {MAX_AFTER}")
        query["after"] = str(int(after))
    wait = 0.0
    raw = get("wait", None)
    if raw is not None:
        try:
            wait = float(raw)
        except ValueError:
            wait = math.nan
        if not (0 <= wait < math.inf):  # also false for NaN
            raise BadQuery("'wait' must be a finite number of seconds, 0 or more")
        wait = min(wait, MAX_WAIT_S) or 0.0  # -0 too
        query["wait"] = f"{wait:g}"
    return query, wait


class ProxyHandler(APIHandler):
    """Passes one allowed call to the backend with the extension's token; the answer comes back as it was."""

    def initialize(self, upstream: Upstream) -> None:
        self.upstream = upstream

    @web.authenticated
    async def get(self, path: str) -> None:
        await self._forward("GET", path)

    @web.authenticated
    async def post(self, path: str) -> None:
        await self._forward("POST", path)

    async def _forward(self, method: str, path: str) -> None:
        if not any(p.fullmatch(path) for p in ALLOWED[method]):
            self._reply(404, {"error": f"/aibro/api/{path[:100]} is not something the proxy passes on ({method})"})
            return
        try:
            query, wait = event_query(self.get_query_argument)
        except BadQuery as exc:
            self._reply(400, {"error": str(exc)})
            return
        if not any(p.fullmatch(path) for p in EVENT_ROUTES):
            query, wait = {}, 0.0  # only the event routes take them
        try:
            answer = await self.upstream.forward(method, f"/{path}", query, wait)
        except Unreachable as exc:
            self.log.warning("aibro_jupyter: %s", exc.detail)
            self._reply(502, {"error": exc.message, "reconnecting": True})
            return
        if answer.status == 401:  # the extension's token, not the user's session: never ask the browser for it
            self._reply(502, {"error": "the aibro backend rejected this server's token; run `aibro login` again"})
            return
        self.set_status(answer.status)
        self.set_header("Content-Type", "application/json")
        self.finish(answer.body)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


def setup_handlers(web_app: Any, upstream: Upstream) -> None:
    base = web_app.settings["base_url"]
    route = url_path_join(base, "aibro", "api", "(.*)")
    web_app.add_handlers(".*$", [(route, ProxyHandler, {"upstream": upstream})])
