"""The backend service: builds the tornado application, runs the scheduler, and writes where it listens."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import tornado.httpserver
import tornado.web
from tornado.ioloop import PeriodicCallback

from aibro_core.files import write_private
from aibro_core.vocabulary import CLOSING, INSTANCE_LIVE

from .accounts import store_path
from .api import tokens, transfer, user, worker
from .api.base import BaseHandler
from .api.openapi import OpenApiHandler
from .blobs import BlobStore
from .bus import EventBus
from .policy import Policy
from .providers.local import LocalProvider
from .scheduler import Scheduler
from .state import Backend
from .store import Store

log = logging.getLogger("aibro.backend")
MAX_BODY = 64 * 1024 * 1024


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        self.set_status(404)
        self.finish(json.dumps({"error": f"no route {self.request.method} {self.request.path}"}))


def routes(backend: Backend) -> list:
    a = {"backend": backend}
    p = "/api/v1"
    return [
        (p + r"/health", user.HealthHandler, a),
        (p + r"/machines", user.MachinesHandler, a),
        (p + r"/policy", user.PolicyHandler, a),
        (p + r"/stats", user.StatsHandler, a),
        (p + r"/auth/tokens", tokens.TokensHandler, a),
        (p + r"/blobs/([^/]+)", transfer.BlobHandler, a),
        (p + r"/jobs", user.JobsHandler, a),
        (p + r"/jobs/([\w-]+)", user.JobHandler, a),
        (p + r"/jobs/([\w-]+)/cancel", user.CancelHandler, a),
        (p + r"/jobs/([\w-]+)/replay", user.ReplayHandler, a),
        (p + r"/jobs/([\w-]+)/events", user.JobEventsHandler, a),
        (p + r"/events", user.UserEventsHandler, a),
        (p + r"/jobs/([\w-]+)/artifacts", user.ArtifactsHandler, a),
        (p + r"/jobs/([\w-]+)/artifacts/(.+)", transfer.ArtifactHandler, a),
        (p + r"/instances", user.InstancesHandler, a),
        (p + r"/instances/([\w-]+)/terminate", user.TerminateHandler, a),
        (p + r"/openapi.json", OpenApiHandler, a),
        (p + r"/worker/assignment", worker.AssignmentHandler, a),
        (p + r"/worker/blobs/([0-9a-f]{64})", transfer.WorkerBlobHandler, a),
        (p + r"/worker/jobs/([\w-]+)/events", worker.WorkerEventsHandler, a),
        (p + r"/worker/jobs/([\w-]+)/artifacts/(.+)", transfer.WorkerArtifactHandler, a),
        (p + r"/worker/jobs/([\w-]+)/finish", worker.WorkerFinishHandler, a),
    ]


def build_backend(home: Path) -> Backend:
    home.mkdir(parents=True, exist_ok=True)
    state = home / "state"
    state.mkdir(parents=True, exist_ok=True)
    store = Store(store_path(home))
    bus = EventBus()
    policy = Policy.from_env()
    capacity = int(os.environ.get("AIBRO_LOCAL_CAPACITY", "0")) or None
    providers = {"local": LocalProvider(state, capacity)}
    holder: dict[str, Backend] = {}
    scheduler = Scheduler(store, providers, policy, lambda: holder["b"].url, lambda ev: bus.publish())
    backend = Backend(home, store, BlobStore(state / "blobs"), policy, bus, scheduler)
    holder["b"] = backend
    return backend


def ensure_local_user(backend: Backend) -> None:
    """The embedded backend's single user, whose token the clients read from ~/.aibro/credentials.json."""
    cred = backend.home / "credentials.json"
    if cred.exists():
        token = json.loads(cred.read_text())["token"]
        if backend.store.user_for_token(token):
            return
    uid = backend.store.ensure_user("local")
    write_private(cred, {"user": "local", "token": backend.store.new_token(uid)})


async def serve(home: Path, host: str, port: int) -> None:
    backend = build_backend(home)
    ensure_local_user(backend)
    app = tornado.web.Application(
        routes(backend), default_handler_class=NotFoundHandler, default_handler_args={"backend": backend}
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    last_port = home / "state" / "last_port"
    if port == 0 and last_port.exists():
        try:  # workers keep the URL they were started with: come back on the same port when it is free
            sock.bind((host, int(last_port.read_text())))
        except (OSError, ValueError):
            sock.bind((host, 0))
    else:
        sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    server = tornado.httpserver.HTTPServer(app, max_body_size=MAX_BODY)
    server.add_sockets([sock])
    bound = sock.getsockname()[1]
    backend.url = f"http://{host}:{bound}"
    last_port.write_text(str(bound))
    write_private(home / "backend.json", {"url": backend.url, "pid": os.getpid(), "port": bound})
    log.info("aibro backend listening on %s (home %s)", backend.url, home)
    ticker = PeriodicCallback(backend.scheduler.tick, 250)
    ticker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ticker.stop()
    shutdown_instances(backend)
    server.stop()
    try:
        info = json.loads((home / "backend.json").read_text())
        if info.get("pid") == os.getpid():
            (home / "backend.json").unlink()
    except (OSError, ValueError):
        pass
    backend.store.close()


def shutdown_instances(backend: Backend) -> None:
    """A clean stop takes this host's workers with it; a job they ran resumes from its checkpoint next start."""
    for inst in backend.store.instances(statuses=(*INSTANCE_LIVE, CLOSING)):
        provider = backend.scheduler.providers[inst["provider"]]
        if inst["provider"] == "local":
            provider.terminate(inst)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aibro-backend", description="Run the aibro training backend.")
    parser.add_argument("--home", default=os.environ.get("AIBRO_HOME", str(Path.home() / ".aibro")))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: any free port)")
    args = parser.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # the daemon's log file shows what happened, as it happens
        getattr(stream, "reconfigure", lambda **_: None)(line_buffering=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("tornado.access").setLevel(logging.WARNING)  # errors only: workers poll several times a second
    asyncio.run(serve(Path(args.home), args.host, args.port))


if __name__ == "__main__":
    main()
