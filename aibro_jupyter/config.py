"""Where the backend is and who the user is: AIBRO_BACKEND_URL/AIBRO_TOKEN, `aibro login`, or the embedded
daemon, which the first client starts (detached, so it outlives the kernel) and every later client reuses."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aibro_core.errors import AibroError, BackendUnreachable

from .settings import KernelSettings


def home() -> Path:
    return KernelSettings.from_env().home


@dataclass(frozen=True)
class Target:
    url: str
    token: str
    embedded: bool
    ca_bundle: str | None = None  # the PEM that verifies an HTTPS backend (`aibro login --ca-bundle`)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def login_file() -> Path:
    return home() / "login.json"


def configured_target() -> Target | None:
    """A shared or cloud backend named by the environment or by `aibro login`."""
    settings = KernelSettings.from_env()
    if settings.backend_url:
        if not settings.token:
            raise AibroError("AIBRO_BACKEND_URL is set but AIBRO_TOKEN is not: set both, or run `aibro login`")
        return Target(settings.backend_url, settings.token, False, settings.ca_bundle)
    saved = _read_json(login_file())
    if saved and saved.get("url") and saved.get("token"):
        return Target(saved["url"], saved["token"], False, settings.ca_bundle or saved.get("ca_bundle"))
    return None


def embedded_target() -> Target | None:
    """The running embedded daemon, if its files say where it is and it still runs."""
    info = _read_json(home() / "backend.json")
    cred = _read_json(home() / "credentials.json")
    if not info or not cred:
        return None
    if not _pid_alive(int(info.get("pid", 0))):
        return None
    return Target(info["url"], cred["token"], True)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@contextmanager
def _start_lock() -> Iterator[None]:
    home().mkdir(parents=True, exist_ok=True, mode=0o700)
    with os.fdopen(os.open(home() / "start.lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_embedded(timeout: float = 60.0) -> Target:
    """Start the embedded backend as a detached daemon (own session), unless one already runs."""
    with _start_lock():
        found = embedded_target()
        if found:
            return found
        h = home()
        h.mkdir(parents=True, exist_ok=True, mode=0o700)
        (h / "backend.json").unlink(missing_ok=True)
        fd = os.open(h / "backend.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # private from the first byte, and so is one an older version made
        log = os.fdopen(fd, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "aibro_backend", "--home", str(h)],
            env={**os.environ, **embedded_env(KernelSettings.from_env())},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = embedded_target()
            if found:
                return found
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise BackendUnreachable(f"the embedded aibro backend did not start; see {h / 'backend.log'}")


def embedded_env(settings: KernelSettings) -> dict[str, str]:
    """What the embedded backend is told beyond the kernel's own environment: its one user may load unsafe models,
    and a spare worker makes a first job as fast as a warm one (unless the kernel's settings say otherwise)."""
    return {
        KernelSettings.variable("allow_unsafe"): settings.allow_unsafe,
        KernelSettings.variable("spare_worker"): "1" if settings.spare_worker else "0",
    }


def say_once_unconfined() -> None:
    """The embedded backend runs jobs unconfined where bubblewrap is missing: say so on screen, once per home."""
    marker = home() / "unconfined-notice"
    if marker.exists():
        return
    print(
        "note: jobs on the embedded backend run unconfined, as your own user (bubblewrap is not installed). That "
        "is fine for your own code on your own machine; to confine them: apt-get install bubblewrap, then "
        "`aibro backend stop` (the next job starts it again, sandboxed).",
        file=sys.stderr,
        flush=True,
    )
    marker.write_text("shown\n")


def resolve(start: bool = True) -> Target:
    """The backend every client uses: configured first, else the embedded daemon (started if needed)."""
    target = configured_target()
    if target:
        return target
    found = embedded_target()
    if found:
        return found
    if not start:
        raise BackendUnreachable("no embedded aibro backend is running: start one with `aibro backend start`")
    return start_embedded()


def stop_embedded(timeout: float = 15.0) -> bool:
    """Stop the embedded daemon (SIGTERM, then SIGKILL); True if one was running."""
    info = _read_json(home() / "backend.json")
    if not info or not _pid_alive(int(info.get("pid", 0))):
        return False
    pid = int(info["pid"])
    os.kill(pid, 15)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.05)
    if _pid_alive(pid):
        os.kill(pid, 9)
    (home() / "backend.json").unlink(missing_ok=True)
    return True
