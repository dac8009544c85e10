"""The one route table (aibro_core/routes.py) against what derives from it: the backend's handlers answer exactly
the methods the table names for their path, and the proxy passes on exactly the routes marked for the browser."""

from __future__ import annotations

import re

import pytest
from tornado.web import RequestHandler

from aibro_backend.server.routes import HANDLERS, routes
from aibro_core import routes as table
from aibro_jupyter.server import handlers as proxy

pytestmark = pytest.mark.fast
METHODS = ("get", "head", "post", "put", "delete")


def test_every_path_has_one_handler_answering_exactly_its_methods() -> None:
    assert set(HANDLERS) == set(table.paths())
    for path, handler in HANDLERS.items():
        named = {e.method for e in table.ENDPOINTS if e.path == path}
        answered = {m for m in METHODS if getattr(handler, m) is not getattr(RequestHandler, m)}
        assert answered == named, f"{handler.__name__} answers {sorted(answered)}; the table says {sorted(named)}"


def test_the_app_serves_the_table_in_its_order() -> None:
    served = [pattern for pattern, *_ in routes(None)]  # type: ignore[arg-type]
    assert served == [table.pattern(p) for p in table.paths()]
    concrete = {"job_id": "job-1", "instance_id": "i-1", "study_id": "study-1", "token_id": "t1", "upload_id": "u" * 32}
    concrete |= {"sha256": "a" * 64, "name": "checkpoints/epoch-0001.keras", "env_key": "0a1b-py311-x86_64-2c3d"}
    for path in table.paths():
        url = table.PREFIX + re.sub(r"\{(\w+)\}", lambda m: concrete[m.group(1)], path)
        first = next(p for p in served if re.fullmatch(p, url))
        assert first == table.pattern(path), f"{url} is answered by {first}, not by its own route"


def test_the_proxy_passes_on_the_browser_routes_only() -> None:
    for e in table.ENDPOINTS:
        url = re.sub(r"\{\w+\}", "job-1", e.path).lstrip("/")
        passes = e.method.upper() in proxy.ALLOWED and any(p.fullmatch(url) for p in proxy.ALLOWED[e.method.upper()])
        assert passes == e.browser, f"{e.method.upper()} {e.path}: browser={e.browser}, the proxy passes={passes}"
    assert not any(p.fullmatch("jobs/" + "x" * 101) for p in proxy.ALLOWED["GET"])
