"""The backend service: builds its parts (store, blobs, providers, scheduler), serves the routes behind the request
guard (guard.py) on the listener (listener.py), runs the upkeep, and writes where it listens."""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tornado.ioloop import IOLoop, PeriodicCallback

from aibro_core.envsettings import SettingsError
from aibro_core.files import write_private
from aibro_core.serveflags import add_serve_flags
from aibro_core.vocabulary import CLOSING, INSTANCE_LIVE

from ..providers import jobnet, shipping
from ..providers.local import LocalProvider
from ..providers.sandbox import SandboxRequired, require_confinement
from ..scheduling.policy import Policy
from ..scheduling.scheduler import Scheduler
from ..storage import claims
from ..storage.blobs import BlobStore
from ..storage.bus import EventBus
from ..storage.s3blobs import S3Backing, s3_backing
from ..storage.store import Store
from ..tuning.studies import StudyDriver
from ..worker.joblimits import JobLimits
from ..worker.version import agent_version
from .accesslog import RedactingFormatter, log_request
from .accounts import store_path
from .guard import GuardedApplication
from .limits import Limits, limits_of
from .listener import GuardedHTTPServer, connection_cap, raise_fd_limit
from .routes import NotFoundHandler, routes
from .state import Backend

log = logging.getLogger("aibro.backend")
STUDY_STEP_MS = 250  # how often running studies report ended trials and fill their slots


def load_aws_provider(config_path: str, home: Path) -> Any:
    """The AWS provider from the config file, validated and checked against the account (every problem named in
    one AwsConfigError) before the backend listens; boto3 uses its usual credential chain."""
    from ..providers.aws_config import AwsConfigError, load_aws_config

    try:
        import boto3
    except ImportError:
        raise AwsConfigError(config_path, ['boto3 is not installed: pip install "aibro-backend[serve,aws]"']) from None
    from ..providers.aws import AwsProvider

    config = load_aws_config(config_path)
    session = boto3.Session(region_name=config.region)
    config = load_aws_config(config_path, session)
    return AwsProvider(config, session, agent=shipping.served(home))


RAY_FIX = (
    "start the cluster's head there (`ray start --head --port 6379`), or pass the address its head printed "
    "(`ray status` on a node shows it): --ray-address HOST:PORT"
)


def load_ray_provider(address: str, home: Path, worker_url: str | None, node_resource: str | None) -> Any:
    """The Ray provider, connected to its cluster before the backend listens (Ray runs in the provider's bridge
    process, never in this one); a missing Ray or an unreachable cluster is a RayClusterError naming the address."""
    from ..providers.ray import RayClusterError, RayProvider, RayUnavailable

    try:
        provider = RayProvider(address, home / "state", backend_url=worker_url, node_resource=node_resource)
    except (RayUnavailable, ValueError) as exc:
        raise RayClusterError(address, str(exc)) from None
    timeout = float(os.environ.get("AIBRO_RAY_CONNECT_S") or 90)
    if not provider.wait_ready(timeout):
        why = provider.cluster_error() or f"no answer from the Ray cluster at {address} within {timeout:g} s"
        provider.close()
        raise RayClusterError(address, f"{why}. Fix: {RAY_FIX}")
    return provider


def load_ssh_provider(hosts_file: str, home: Path, worker_url: str | None) -> Any:
    """The SSH provider: its hosts file checked, then every host logged in to (its key recorded on first contact),
    before the backend listens; every problem is named in one HostsError."""
    from ..providers.ssh import SshProvider
    from ..providers.ssh_hosts import HostsError, load_hosts

    hosts = load_hosts(hosts_file)
    grace = float(os.environ.get("AIBRO_SSH_UNREACHABLE_S") or 60)  # a host out of reach this long loses its jobs
    agent = shipping.served(home)
    provider = SshProvider(hosts, home / "state", agent, worker_url=worker_url, unreachable_grace_s=grace)
    problems = provider.check()
    if problems:
        provider.close()
        raise HostsError(hosts_file, problems)
    return provider


CHECKPOINT_S = 1.0  # WAL checkpoints run this often, off the event loop (store.Store)


def build_backend(home: Path, extra_providers: dict[str, Any] | None = None) -> Backend:
    log.info("agent version %s (what its workers must run)", agent_version())  # of the code loaded now
    shipping.served(home)  # its wheel, of the same code, before anything on disk can change
    for d in (home, home / "state"):  # private whatever the umask was when an older version made them
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        d.chmod(0o700)
    state = home / "state"
    store = Store(store_path(home), checkpoints_every_s=CHECKPOINT_S)
    bus = EventBus()
    policy = Policy.from_env()
    capacity = int(os.environ.get("AIBRO_LOCAL_CAPACITY", "0")) or None
    local = LocalProvider(state, capacity, spare=policy.spare_worker)
    providers: dict[str, Any] = {"local": local}  # the local provider always runs
    providers.update(extra_providers or {})
    holder: dict[str, Backend] = {}
    scheduler = Scheduler(store, providers, policy, lambda: holder["b"].url, bus.publish)
    blobs = BlobStore(state / "blobs", s3_backing(providers.get("aws")))
    backend = Backend(home, store, blobs, policy, bus, scheduler)
    backend.extra["limits"] = Limits.from_env(policy)
    holder["b"] = backend
    return backend


def sweep(backend: Backend) -> None:
    """Partial uploads untouched for the TTL go; so do tokens expired for over a week. With the S3 backing, claims
    not yet proven are published and upload keys due for deletion go (storage/claims.py)."""
    limits = limits_of(backend)
    if backend.blobs.s3 is not None:
        IOLoop.current().spawn_callback(_claims_upkeep, backend, backend.blobs.s3)
    try:
        removed = backend.blobs.sweep_partials(limits.partial_ttl_s)
        if removed:
            log.info("deleted %d partial uploads untouched for %g s", removed, limits.partial_ttl_s)
        backend.store.tokens.drop_expired()
    except Exception:  # noqa: BLE001 - a sweep that fails tries again next time
        log.exception("sweep failed")


async def _claims_upkeep(backend: Backend, s3: S3Backing) -> None:
    try:
        done = await claims.upkeep(backend.store, s3)
    except Exception:  # noqa: BLE001 - tried again at the next sweep
        log.exception("S3 upkeep failed")
        return
    if any(done.values()):
        log.info("S3 upkeep: %d uploads proven and shared, %d upload keys deleted", done["published"], done["deleted"])


def check_confinement(backend: Backend) -> None:
    """A backend shared by several users does not run their code unconfined unless its operator said so
    (`--sandbox none`); one that runs unconfined says so on every start and in GET /health."""
    sandbox = backend.scheduler.providers["local"].sandbox
    mode = (os.environ.get("AIBRO_SANDBOX") or "auto").lower()
    try:
        banner = require_confinement(sandbox.kind, backend.store.users.count(), mode)
    except SandboxRequired as exc:
        log.error("%s", exc)
        print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    backend.extra["sandbox"] = sandbox.kind
    if banner:
        backend.extra["sandbox_warning"] = banner
        log.warning("%s", banner)


def ensure_local_user(backend: Backend) -> None:
    """The embedded backend's single user, whose token the clients read from ~/.aibro/credentials.json."""
    cred = backend.home / "credentials.json"
    if cred.exists():
        token = json.loads(cred.read_text())["token"]
        if backend.store.tokens.user_for(token):
            return
    uid = backend.store.users.ensure("local")
    write_private(cred, {"user": "local", "token": backend.store.tokens.new(uid)})


async def serve(
    home: Path, host: str, port: int, tls: ssl.SSLContext | None = None, extra_providers: dict[str, Any] | None = None
) -> None:
    backend = build_backend(home, extra_providers)
    ensure_local_user(backend)
    check_confinement(backend)
    backend.scheduler.providers["local"].prime(backend.store.users.ensure("local"))  # the embedded user's spare
    limits = limits_of(backend)
    app = GuardedApplication(
        routes(backend),
        default_handler_class=NotFoundHandler,
        default_handler_args={"backend": backend},
        log_function=log_request,
    )
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
    driver = StudyDriver(backend)
    stepper = PeriodicCallback(lambda: IOLoop.current().spawn_callback(driver.step), STUDY_STEP_MS)
    stepper.start()
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
    stepper.stop()
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
    net_dir = backend.scheduler.providers["local"].net_dir
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
    want = os.environ.get("AIBRO_EVENTS_PORT", "").strip().lower()
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


# gen0 collections every 20,000 net allocations (not 700), a full one at most every 2,000 of those
GC_THRESHOLDS = (20_000, 20, 100)


def tune_gc() -> None:
    """Keep the cyclic garbage collector from stalling the event loop. Under a team's load a thousand waiting
    long-polls keep ~100,000 objects alive that die a second later, so with Python's default thresholds a full
    collection ran every ~3 s and took ~90 ms (bench_load at 1,500 events/s: 42 of them in two minutes, each one a
    pause for every request). What is alive once the backend is up (modules, routes, providers) is frozen out of
    collections, and collections run less often; reference counting still frees all acyclic garbage at once."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


RECONCILE_S = 300.0


def start_upkeep(backend: Backend) -> PeriodicCallback:
    """Cloud providers outlive the backend: adopt their live machines now (by tag), then reconcile every few
    minutes (AIBRO_RECONCILE_S, default 300: machines the store does not know as live or stopped, or whose time is
    up, are terminated). Both run in the providers' pools; their answers are logged on the loop."""
    sched, loop = backend.scheduler, IOLoop.current()

    def report(what: str) -> Callable[[Any], None]:
        def done(fut: Any) -> None:
            try:
                found = fut.result()
            except Exception as exc:  # noqa: BLE001 - logged; the next round tries again
                log.warning("%s failed: %s", what, exc)
                return
            if found:
                log.info("%s: %s", what, found)

        return done

    adopted = sched.adopt_all()
    for fut in adopted:
        loop.add_future(fut, report("adopted"))

    def reconcile() -> None:
        if any(not f.done() for f in adopted):
            return  # after adoption, never before: the picture must hold what this backend left running
        for fut in sched.reconcile_all():
            loop.add_future(fut, report("reconciled (terminated)"))

    every_s = float(os.environ.get("AIBRO_RECONCILE_S") or RECONCILE_S)
    reconciler = PeriodicCallback(reconcile, 1000 * every_s)
    if adopted:
        reconciler.start()
    return reconciler


def shutdown_instances(backend: Backend) -> None:
    """A clean stop takes this host's workers with it; a job they ran resumes from its checkpoint next start."""
    for inst in backend.store.instances.list(statuses=(*INSTANCE_LIVE, CLOSING)):
        if inst.provider == "local":  # cloud machines stay: the next start adopts them
            backend.scheduler.providers["local"].terminate(inst)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plain_http_warning(host: str) -> str:
    return (
        f"aibro backend: WARNING: listening on {host} over plain HTTP: tokens, models and data cross the network "
        "unencrypted and anyone who can reach this port can try tokens. Serve TLS (--certfile CERT --keyfile KEY), "
        "or keep --host 127.0.0.1 behind an HTTPS reverse proxy."
    )


def tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def settings_problems() -> list[str]:
    """Every wrong AIBRO_* setting (policy, service limits, job limits), named at once before anything starts."""
    problems, policy = [], Policy()
    try:
        policy = Policy.from_env()
    except SettingsError as exc:
        problems.append(str(exc))
    for check in (lambda: Limits.from_env(policy), lambda: JobLimits.from_env(os.environ)):
        try:
            check()
        except ValueError as exc:  # SettingsError is one
            problems.append(str(exc))
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aibro-backend", description="Run the aibro training backend.")
    parser.add_argument("--home", default=os.environ.get("AIBRO_HOME", str(Path.home() / ".aibro")))
    add_serve_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.umask(0o077)  # everything the backend writes (database, WAL, logs, blobs, artifacts) is private to its user
    parser = build_parser()
    args = parser.parse_args(argv)
    args.provider = args.provider or []
    args.ca_bundle = args.ca_bundle or os.environ.get("AIBRO_CA_BUNDLE")
    args.sandbox = args.sandbox or os.environ.get("AIBRO_SANDBOX") or "auto"
    os.environ["AIBRO_SANDBOX"] = args.sandbox  # the local provider reads it (providers/sandbox.py)
    ray_opts = args.ray_address or args.ray_worker_url or args.ray_node_resource
    if "ray" in args.provider and not args.ray_address:
        parser.error("--provider ray needs --ray-address HOST:PORT (the address `ray start --head` printed)")
    if ray_opts and "ray" not in args.provider:
        parser.error("--ray-address, --ray-worker-url and --ray-node-resource go with --provider ray")
    if "aws" in args.provider and not args.aws_config:
        parser.error("--provider aws needs --aws-config FILE (region, subnet, security groups, bucket, ...)")
    if args.aws_config and "aws" not in args.provider:
        parser.error("--aws-config goes with --provider aws")
    if "ssh" in args.provider and not args.ssh_hosts:
        parser.error("--provider ssh needs --ssh-hosts FILE (one [[host]] table per machine: name, host, user, ...)")
    if (args.ssh_hosts or args.ssh_worker_url) and "ssh" not in args.provider:
        parser.error("--ssh-hosts and --ssh-worker-url go with --provider ssh")
    for stream in (sys.stdout, sys.stderr):  # the daemon's log file shows what happened, as it happens
        getattr(stream, "reconfigure", lambda **_: None)(line_buffering=True)
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("tornado.access").setLevel(logging.WARNING)  # errors only: workers poll several times a second
    try:
        tls = tls_context(args.certfile, args.keyfile)
    except (OSError, ssl.SSLError) as exc:
        parser.error(f"cannot load the TLS certificate/key: {exc}")
    if args.ca_bundle:  # local workers get a copy, cloud machines the PEM in their user data (AIBRO_CA_BUNDLE)
        try:
            ssl.create_default_context(cafile=args.ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            parser.error(f"--ca-bundle {args.ca_bundle}: not a readable PEM CA bundle ({exc})")
        os.environ["AIBRO_CA_BUNDLE"] = os.path.abspath(args.ca_bundle)
    if tls is None and not is_loopback(args.host):
        print(plain_http_warning(args.host), file=sys.stderr, flush=True)
    problems = settings_problems()
    if problems:
        print("aibro backend: " + "\n  ".join(problems), file=sys.stderr, flush=True)
        sys.exit(2)
    extra: dict[str, Any] = {}
    if args.aws_config:
        from ..providers.aws_config import AwsConfigError

        try:
            extra["aws"] = load_aws_provider(args.aws_config, Path(args.home))
        except AwsConfigError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    if args.ray_address:
        from ..providers.ray import RayClusterError

        try:
            extra["ray"] = load_ray_provider(
                args.ray_address, Path(args.home), args.ray_worker_url, args.ray_node_resource
            )
        except RayClusterError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    if args.ssh_hosts:
        from ..providers.ssh_hosts import HostsError

        try:
            extra["ssh"] = load_ssh_provider(args.ssh_hosts, Path(args.home), args.ssh_worker_url)
        except HostsError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    run_loop(serve(Path(args.home), args.host, args.port, tls, extra))


if __name__ == "__main__":
    main()


def run_loop(main: Any) -> None:
    """Run the backend's event loop: uvloop's when it is installed (the same asyncio API, its I/O layer in C: under
    a team's load most of the backend's time is per-request socket work), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
