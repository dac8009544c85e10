"""The `/aibro/api/*` routes: an allow-list of the backend's user API, behind Jupyter's authentication."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..errors import AibroError
from .upstream import LONG_POLL_SLACK_S, Upstream

_ID = r"[\w-]{1,100}"
ALLOWED = {
    "GET": [
        re.compile(p)
        for p in (
            r"health",
            r"machines",
            r"policy",
            r"jobs",
            rf"jobs/{_ID}",
            rf"jobs/{_ID}/events",
            rf"jobs/{_ID}/artifacts",
            r"events",
            r"instances",
        )
    ],
    "POST": [re.compile(p) for p in (rf"jobs/{_ID}/cancel", rf"instances/{_ID}/terminate")],
}
PASSED_QUERY = ("after", "wait")


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
        params = {k: self.get_query_argument(k) for k in PASSED_QUERY if self.get_query_argument(k, None)}
        try:
            wait = float(params.get("wait", 0))
        except ValueError:
            self._reply(400, {"error": "'wait' must be a number of seconds"})
            return
        loop = asyncio.get_running_loop()
        try:
            resp = await loop.run_in_executor(
                self.upstream.pool,
                lambda: self.upstream.forward(method, f"/{path}", params, timeout=wait + LONG_POLL_SLACK_S),
            )
        except AibroError as exc:
            self._reply(502, {"error": str(exc), "reconnecting": True})
            return
        if resp.status_code == 401:  # the extension's token, not the user's session: never ask the browser for it
            self._reply(502, {"error": "the aibro backend rejected this server's token; run `aibro login` again"})
            return
        self.set_status(resp.status_code)
        self.set_header("Content-Type", "application/json")
        self.finish(resp.content)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


def setup_handlers(web_app: Any, upstream: Upstream) -> None:
    base = web_app.settings["base_url"]
    route = url_path_join(base, "aibro", "api", "(.*)")
    web_app.add_handlers(".*$", [(route, ProxyHandler, {"upstream": upstream})])
