"""The backend's parts built and wired once: the store, the blobs, the providers, the scheduler, and the tornado
application that serves the routes behind the request guard."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from aibro_core.files import write_private

from ..providers import shipping
from ..providers.base import Provider
from ..providers.local import LocalProvider
from ..providers.sandbox import SandboxRequired, require_confinement
from ..scheduling.policy import Policy
from ..scheduling.scheduler import Scheduler
from ..settings import BackendSettings
from ..storage.blobs import BlobStore
from ..storage.bus import EventBus
from ..storage.store import Store
from ..worker.version import agent_version
from .accesslog import log_request
from .accounts import store_path
from .guard import GuardedApplication
from .limits import Limits
from .loaders import ExtraProviders
from .routes import NotFoundHandler, routes
from .state import Backend

log = logging.getLogger("aibro.backend")
CHECKPOINT_S = 1.0  # WAL checkpoints run this often, off the event loop (store.Store)


def build_backend(home: Path, extra: ExtraProviders | None = None) -> Backend:
    """The backend's parts for `home`: the local provider always, the `extra` ones loaded beside it."""
    extra = extra or ExtraProviders()
    log.info("agent version %s (what its workers must run)", agent_version())  # of the code loaded now
    shipping.served(home)  # its wheel, of the same code, before anything on disk can change
    for d in (home, home / "state"):  # private whatever the umask was when an older version made them
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        d.chmod(0o700)
    state = home / "state"
    store = Store(store_path(home), checkpoints_every_s=CHECKPOINT_S)
    bus = EventBus()
    settings = BackendSettings.from_env()
    policy = Policy.of(settings)
    capacity = settings.local_capacity or None
    local = LocalProvider(state, capacity, spare=policy.spare_worker)
    providers: dict[str, Provider] = {"local": local}  # the local provider always runs
    providers.update(extra.table())
    holder: dict[str, Backend] = {}
    scheduler = Scheduler(store, providers, policy, lambda: holder["b"].url, bus.publish)
    blobs = BlobStore(state / "blobs", extra.s3_backing())
    backend = Backend(home, store, blobs, policy, bus, scheduler, local, Limits.of(settings, policy))
    holder["b"] = backend
    return backend


def build_app(backend: Backend) -> GuardedApplication:
    """The tornado application: every route behind the request guard, unknown paths answered as JSON."""
    return GuardedApplication(
        routes(backend),
        default_handler_class=NotFoundHandler,
        default_handler_args={"backend": backend},
        log_function=log_request,
    )


def check_confinement(backend: Backend) -> None:
    """A backend shared by several users does not run their code unconfined unless its operator said so
    (`--sandbox none`); one that runs unconfined says so on every start and in GET /health."""
    sandbox = backend.local.sandbox
    mode = BackendSettings.from_env().sandbox
    try:
        banner = require_confinement(sandbox.kind, backend.store.users.count(), mode)
    except SandboxRequired as exc:
        log.error("%s", exc)
        print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    backend.sandbox = sandbox.kind
    if banner:
        backend.sandbox_warning = banner
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
