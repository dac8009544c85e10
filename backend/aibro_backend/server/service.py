"""The running backend: it listens (the main port, the event port, the jobs' own network), runs the scheduler's
tick, the studies and the upkeep, writes where it listens, and stops cleanly on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import ssl
from pathlib import Path

from tornado.ioloop import PeriodicCallback

from aibro_core.files import write_private
from aibro_core.vocabulary import CLOSING, INSTANCE_LIVE

from ..providers import jobnet
from ..settings import BackendSettings
from ..tuning.studies import StudyDriver
from .composition import build_app, build_backend, check_confinement, ensure_local_user
from .limits import Limits
from .listener import GuardedHTTPServer, connection_cap, raise_fd_limit
from .loaders import ExtraProviders
from .state import Backend
from .upkeep import start_upkeep, sweep, tune_gc

log = logging.getLogger("aibro.backend")


async def serve(
    home: Path, host: str, port: int, tls: ssl.SSLContext | None = None, extra: ExtraProviders | None = None
) -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly: requests first, this host's workers, then the providers."""
    backend = build_backend(home, extra)
    ensure_local_user(backend)
    check_confinement(backend)
    backend.local.prime(backend.store.users.ensure("local"))  # the embedded user's spare
    limits = backend.limits
    app = build_app(backend)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    last_port = home / "state" / "last_port"
    if port == 0 and last_port.exists():
        try:  # workers keep the URL they were started with: come back on the same port when it is free
            sock.bind((host, int(last_port.read_text())))
        except (OSError, ValueError):
            sock.bind((host, 0))
    else:
        sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    cap = connection_cap(limits, raise_fd_limit())
    server = GuardedHTTPServer(
        app,
        ssl_options=tls,
        max_body_size=limits.json_max_body,  # each request's own limit is set from its route (header_refusal)
        body_timeout=limits.body_timeout_s,
        idle_connection_timeout=limits.idle_timeout_s,
        max_connections=cap,
        chunk_size=1 << 20,  # upload bodies reach handlers 1 MiB at a time, not tornado's 64 KiB
    )
    server.add_sockets([sock])
    write_watch = server.watch_writes(limits.idle_timeout_s)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    backend.url = f"{'https' if tls else 'http'}://{shown}:{bound}"
    job_proxies = await open_job_network(backend, server)
    backend.events_port = open_event_port(backend, server, host, limits, tls)
    last_port.write_text(str(bound))
    info = {"url": backend.url, "pid": os.getpid(), "port": bound, "events_port": backend.events_port}
    write_private(home / "backend.json", info)
    log.info(
        "aibro backend listening on %s (home %s, at most %d connections%s)",
        backend.url,
        home,
        cap,
        f"; event long-polls also on port {backend.events_port}" if backend.events_port else "",
    )
    ticker = PeriodicCallback(backend.scheduler.tick, 250)
    ticker.start()
    reconciler = start_upkeep(backend)
    sweep(backend)
    sweeper = PeriodicCallback(lambda: sweep(backend), 1000 * min(600.0, max(1.0, limits.partial_ttl_s / 4)))
    sweeper.start()
    driver = backend.study_driver = StudyDriver(backend)
    driver.start()  # it follows the events (a job's end, a study's start or end), never a clock
    tune_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    backend.bus.close()  # waiting long-polls answer (empty) instead of being cancelled with the loop
    await asyncio.sleep(0.2)
    ticker.stop()
    sweeper.stop()
    await driver.close()
    reconciler.stop()
    write_watch.stop()
    shutdown_instances(backend)
    await server.close_everything()  # first: a provider's close may block the loop, and requests must not wait on it
    for provider in backend.scheduler.providers.values():
        provider.close()
    for proxy in job_proxies:
        proxy.close()
    try:
        info = json.loads((home / "backend.json").read_text())
        if info.get("pid") == os.getpid():
            (home / "backend.json").unlink()
    except (OSError, ValueError):
        pass
    log.info(backend.group_commit.summary())
    backend.store.close()


async def open_job_network(backend: Backend, server: GuardedHTTPServer) -> list[jobnet.PackageProxy]:
    """Where sandboxed jobs have no network of their own (providers/jobnet.py): the backend also answers on a Unix
    socket their workers reach, a proxy to the package index serves their environment builds, and where the bytes
    live in S3 a proxy to the bucket's endpoint carries their presigned transfers."""
    net_dir = backend.local.net_dir
    if net_dir is None:
        return []
    (net_dir / jobnet.STORAGE_SOCK).unlink(missing_ok=True)  # a backend that no longer uses S3 offers no way there
    server.add_sockets([jobnet.bind_unix(net_dir / jobnet.BACKEND_SOCK)])
    hosts = jobnet.package_hosts(os.environ)
    proxies = [jobnet.PackageProxy(hosts)]
    await proxies[0].start(net_dir / jobnet.PACKAGES_SOCK)
    said = f"while pip builds their environments {', '.join(sorted(hosts))}"
    if backend.blobs.s3 is not None:
        bucket = jobnet.host_of(backend.blobs.s3.get_url(backend.blobs.s3.blob_key("0" * 64)))
        # the worker's HTTP then goes through it, its calls to this backend included
        allowed = {bucket, jobnet.host_of(backend.url)}
        fix = ": AIBRO_JOB_NETWORK=host where the backend runs gives jobs the host's network"
        proxies.append(jobnet.PackageProxy(allowed, "this backend and the bucket that holds its bytes", fix))
        await proxies[1].start(net_dir / jobnet.STORAGE_SOCK)
        said += f", and {bucket} for their bytes"
    log.info("jobs reach only this backend, %s", said)
    return proxies


def open_event_port(
    backend: Backend, server: GuardedHTTPServer, host: str, limits: Limits, tls: ssl.SSLContext | None
) -> int | None:
    """The lean long-poll listener beside the main port (api/eventport.py): AIBRO_EVENTS_PORT picks its port
    (default: any free one), `off` leaves long-polls to the main port alone. A port that cannot be bound is a
    warning, not a failed start: clients then long-poll the main port."""
    want = BackendSettings.from_env().events_port.lower()
    if want == "off":
        return None
    try:
        from ..api.eventport import EventPort  # needs httptools (a dependency of the serve extra)
    except ImportError as exc:
        log.info("no event port (%s): long-polls go to the main port", exc)
        return None
    try:
        port = int(want) if want else 0
        return EventPort(backend, server, limits.idle_timeout_s, tls).listen(host, port)
    except (OSError, ValueError) as exc:
        log.warning("no event port (AIBRO_EVENTS_PORT=%r: %s): long-polls go to the main port", want, exc)
        return None


def shutdown_instances(backend: Backend) -> None:
    """A clean stop takes this host's workers with it; a job they ran resumes from its checkpoint next start."""
    for inst in backend.store.instances.list(statuses=(*INSTANCE_LIVE, CLOSING)):
        if inst.provider == "local":  # cloud machines stay: the next start adopts them
            backend.local.terminate(inst)
