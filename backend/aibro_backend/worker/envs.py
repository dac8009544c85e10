"""Per-requirements-hash package environments on a worker host: built once, reused by every later job.

Where the environment sits relative to the worker's own packages
----------------------------------------------------------------
The worker has already imported TensorFlow, Keras and numpy when a job arrives, and the user's list usually
names small packages on top of them. So the environment holds only what the worker lacks (or has at a version
the list excludes), never a second TensorFlow or numpy:

* Build: a venv at ``<cache>/<hash>/venv`` made by the worker's own interpreter, without pip, with one ``.pth``
  file that appends the worker's package directories to the venv's ``sys.path``. pip (the worker's own, found
  through that ``.pth``) runs inside the venv with the default ``only-if-needed`` strategy: it sees the worker's
  packages, so a requirement or dependency they already satisfy is not installed again; one they do not satisfy
  is installed into the venv, and pip never uninstalls anything of the worker's (its packages lie outside the
  venv, which pip leaves alone). ``pip install --target`` was rejected because it ignores what is installed and
  would copy numpy/TensorFlow into every environment; ``--prefix`` because pip then uninstalls conflicting
  packages from the worker's own site-packages. The helper ``.pth`` is removed once pip is done.
* Run: ``activate`` puts the venv's site-packages on ``sys.path`` in front of the worker's site-packages (after
  the standard library), so the pinned version wins for every module not imported yet. A module the worker has
  already imported (numpy, tensorflow, ...) cannot be swapped inside a running process; ``activate`` returns
  such names so the caller can warn. ``deactivate`` takes the directory off ``sys.path`` and drops every module
  loaded from it from ``sys.modules``, so the next job on a warm worker starts clean.

Built once per host: ``<cache>/<hash>/ready`` is written last (atomically), and the build runs under an
exclusive ``flock`` on ``<cache>/<hash>.lock``, so a second worker on the same host waits and then finds it
ready. A failed or interrupted build leaves no ``ready``; the next builder, holding the lock, deletes the
partial directory and starts again. The venv is built in place, not in a temporary directory renamed into
place, because a venv is not relocatable (its scripts and configuration name its path); ``ready`` gives the
same all-or-nothing guarantee. The hash covers the normalised list and the Python major.minor
(``aibro_core.requirements.requirements_hash``), not the worker's own package set: after the host's own
packages change, clear the cache directory.

Shared between the machines of one user (``Shared``): a machine that builds an environment uploads a zip of its
site-packages; the next machine of that user with the same key (``env_key``: the requirements hash, the Python,
the CPU architecture and a digest of the worker's own packages, which decide what pip left out) downloads and
unpacks it instead of resolving and downloading from the index again. Only a user's own machines share: a machine
runs its user's code, so what it built is trusted by that user alone.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from aibro_core.files import private_dir
from aibro_core.requirements import check_requirements, python_tag, requirements_hash, runtime_versions

from . import netbridge

REPORT_EVERY_S = 0.5
PIP_TIMEOUT_S = 1800.0
_HELPER_PTH = "_aibro_worker_packages.pth"
_TAIL_LINES = 25
# pip settings that would send the install somewhere other than the venv.
_PIP_ENV_DROP = ("PIP_TARGET", "PIP_PREFIX", "PIP_USER", "PIP_ROOT", "PIP_REQUIRE_VIRTUALENV", "PYTHONPATH")

_active: list[str] = []


def _stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return [os.path.realpath(p) for p in {paths["stdlib"], paths["platstdlib"]}]


def _is_stdlib(entry: str) -> bool:
    real = os.path.realpath(entry)
    if "site-packages" in real or "dist-packages" in real:
        return False
    return any(real == d or real.startswith(d + os.sep) for d in _stdlib_dirs())


def _worker_package_dirs(exclude: Path | None = None) -> list[str]:
    """The worker's own package directories (site-packages, editable installs), in sys.path order."""
    skip = os.path.realpath(exclude) if exclude is not None else "\0"
    found = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry) or _is_stdlib(entry):
            continue
        real = os.path.realpath(entry)
        if real == skip or real.startswith(skip + os.sep) or entry in _active or real in found:
            continue
        found.append(real)
    return found


def _site_of(root: Path) -> Path:
    info = json.loads((root / "ready").read_text())
    return root / info["site"]


def _failed_requirement(tail: list[str]) -> str | None:
    for line in reversed(tail):
        for marker in ("No matching distribution found for ", "satisfies the requirement "):
            if marker in line:
                return line.split(marker, 1)[1].split(" (")[0].strip()
    return None


def _run_pip(python: Path, reqs: list[str], label: str, report: Callable[[str], None], timeout_s: float) -> None:
    cmd = [str(python), "-I", "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    cmd += ["--no-warn-script-location", "--progress-bar", "off", *reqs]
    env = {k: val for k, val in os.environ.items() if k not in _PIP_ENV_DROP}
    env["PYTHONUNBUFFERED"] = "1"
    empty = tempfile.mkdtemp(prefix="pip-cwd-")  # pip reads no file of the job's: nothing where it starts
    with netbridge.package_proxy() as proxy:  # a sandbox without a network reaches the index only now
        env.update(proxy)
        rc, timed_out, tail = _pip_process(cmd, env, empty, label, report, timeout_s)
    if timed_out:
        raise RuntimeError(
            f"Installing the requirements {reqs} ({label}) took longer than {timeout_s:.0f} s and was stopped. "
            "Fix: check the worker host reaches the package index, or list fewer or smaller packages."
        )
    if rc != 0:
        bad = _failed_requirement(list(tail))
        which = f"the requirement {bad!r} could not be installed" if bad else f"pip failed on {reqs}"
        raise RuntimeError(
            f"Installing the job's requirements failed ({label}): {which}. Fix: check that the name and version "
            "exist on the package index (pip index versions NAME) and correct the requirements list. "
            "pip's last lines:\n" + "\n".join(tail)
        )


def _pip_process(
    cmd: list[str], env: dict[str, str], cwd: str, label: str, report: Callable[[str], None], timeout_s: float
) -> tuple[int, bool, collections.deque[str]]:
    """Run pip with its output reported as progress; (exit status, whether it timed out, its last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        text=True,
        start_new_session=True,  # its own process group: a timeout also stops the build steps pip started
    )
    timed_out = threading.Event()

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def stop() -> None:
        timed_out.set()
        kill()

    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    last_sent, last_line, sent_last = 0.0, "", True
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            if not line:
                continue
            tail.append(line)
            last_line, sent_last = line, False
            now = time.monotonic()
            if now - last_sent >= REPORT_EVERY_S:
                report(f"{label}: {line}")
                last_sent, sent_last = now, True
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill()
            proc.wait()
        shutil.rmtree(cwd, ignore_errors=True)
    if last_line and not sent_last:
        report(f"{label}: {last_line}")
    return rc, timed_out.is_set(), tail


def _build(root: Path, reqs: list[str], label: str, report: Callable[[str], None], timeout_s: float) -> Path:
    if root.exists():
        shutil.rmtree(root)  # a build that failed or was interrupted; we hold the lock
    venv_dir = root / "venv"
    try:
        venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt", clear=True).create(venv_dir)
        python = venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        # Ask the venv's own interpreter (with site, which is what makes it a venv) where it installs.
        probe = "import json, sysconfig; print(json.dumps([sysconfig.get_path(k) for k in ('purelib', 'platlib')]))"
        out = subprocess.run([str(python), "-I", "-c", probe], check=True, capture_output=True, text=True).stdout
        purelib, platlib = json.loads(out)
        inside = os.path.realpath(venv_dir) + os.sep
        if not all(os.path.realpath(p).startswith(inside) for p in (purelib, platlib)):
            raise RuntimeError(
                f"The new environment at {venv_dir} installs into {purelib}, outside itself; refusing to touch the "
                "worker's own packages. Fix: run the worker with an interpreter whose venv module works."
            )
        site_dir = root / os.path.relpath(os.path.realpath(purelib), os.path.realpath(root))
        private_dir(site_dir)
        helper = site_dir / _HELPER_PTH
        helper.write_text("".join(d + "\n" for d in _worker_package_dirs(root)))
        report(f"{label}: installing {', '.join(reqs)}")
        _run_pip(python, reqs, label, report, timeout_s)
        helper.unlink()
        if os.path.realpath(platlib) != os.path.realpath(purelib) and Path(platlib).is_dir():
            (site_dir / "_aibro_platlib.pth").write_text(platlib + "\n")
        ready = root / "ready.tmp"
        info = {"site": str(site_dir.relative_to(root)), "requirements": reqs, "python": sys.version.split()[0]}
        ready.write_text(json.dumps(info))
        os.replace(ready, root / "ready")
        return site_dir
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


class Shared(Protocol):
    """Where the environments of a user's machines meet (the agent's: GET /worker/envs/KEY, a job artifact)."""

    def fetch(self, key: str, dest: Path) -> bool:
        """Download environment `key` into the file `dest`; False when no machine has shared it yet."""

    def offer(self, key: str, source: Path) -> None:
        """Upload the zip `source` as environment `key` for the user's next machines."""


_base_digest: list[str] = []


def env_key(digest: str) -> str:
    """What an environment built here fits: its requirements hash, this Python, this CPU architecture, and the
    worker's own packages (pip installed only what they lack)."""
    if not _base_digest:
        dists = importlib.metadata.distributions(path=_worker_package_dirs())
        names = sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in dists if d.metadata["Name"]})
        _base_digest.append(hashlib.sha256("\n".join(names).encode()).hexdigest()[:16])
    machine = platform.machine().lower() or "unknown"
    return f"{digest[:32]}-py{python_tag().replace('.', '')}-{machine}-{_base_digest[0]}"


def _zip_site(site_dir: Path, dest: Path) -> None:
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for path in sorted(site_dir.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                zf.write(path, path.relative_to(site_dir).as_posix())


def _unpack(root: Path, reqs: list[str], archive: Path) -> Path:
    """An environment from another machine: its site-packages unpacked under `root` (zipfile never writes
    outside the folder it extracts to), then `ready`."""
    if root.exists():
        shutil.rmtree(root)
    site_dir = root / "site"
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(site_dir)
        info = {"site": "site", "requirements": reqs, "python": sys.version.split()[0], "shared": True}
        (root / "ready.tmp").write_text(json.dumps(info))
        os.replace(root / "ready.tmp", root / "ready")
        return site_dir
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _from_shared(
    shared: Shared, key: str, root: Path, reqs: list[str], label: str, report: Callable[[str], None]
) -> Path | None:
    archive = root.with_name(root.name + ".zip.part")
    started = time.monotonic()
    try:
        if not shared.fetch(key, archive):
            return None
        site_dir = _unpack(root, reqs, archive)
    except Exception as exc:  # noqa: BLE001 - a broken download is built here instead
        report(f"{label}: the shared copy could not be used ({exc}); building it here")
        return None
    finally:
        archive.unlink(missing_ok=True)
    report(f"{label} ready (downloaded, built by another of your machines, in {time.monotonic() - started:.1f} s)")
    return site_dir


def _share(shared: Shared, key: str, site_dir: Path, label: str, report: Callable[[str], None]) -> None:
    archive = Path(tempfile.mkdtemp(prefix="env-share-")) / f"{key}.zip"
    try:
        _zip_site(site_dir, archive)
        shared.offer(key, archive)
        report(f"{label} shared with your next machines ({archive.stat().st_size / 1e6:.1f} MB)")
    except Exception as exc:  # noqa: BLE001 - sharing is a saving, never a reason to fail the job
        report(f"{label}: could not share it with your other machines ({exc})")
    finally:
        shutil.rmtree(archive.parent, ignore_errors=True)


def ensure_env(
    requirements: list[str],
    cache_dir: Path,
    report: Callable[[str], None],
    timeout_s: float = PIP_TIMEOUT_S,
    shared: Shared | None = None,
) -> Path | None:
    """The site-packages directory holding `requirements`, built on first use and cached per hash (None if empty).

    `report` receives progress lines (throttled to about two a second, plus the last one) for the GEARING UP ENV
    substatus. With `shared`, an environment another machine of the user built is downloaded instead of built,
    and one built here is offered to the next. Raises RuntimeError with pip's last lines and the fix when a
    requirement cannot be installed, and aibro_core.errors.ValidationError when the list itself is malformed.
    """
    reqs = check_requirements(requirements)
    if not reqs:
        return None
    digest = requirements_hash(reqs)
    label = f"environment {digest[:12]}"
    cache_dir = Path(cache_dir)
    root = cache_dir / digest
    if (root / "ready").exists():
        report(f"{label} ready (cached)")
        return _site_of(root)
    private_dir(cache_dir)
    with open(cache_dir / f"{digest}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"{label}: waiting for another worker on this host that is building it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (root / "ready").exists():
                report(f"{label} ready (cached)")
                return _site_of(root)
            key = env_key(digest)
            if shared is not None and (site_dir := _from_shared(shared, key, root, reqs, label, report)):
                return site_dir
            started = time.monotonic()
            site_dir = _build(root, reqs, label, report, timeout_s)
            report(f"{label} ready (built in {time.monotonic() - started:.1f} s)")
            if shared is not None:
                _share(shared, key, site_dir, label, report)
            return site_dir
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _under(path: str | None, dirs: list[str]) -> bool:
    if not path:
        return False
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + os.sep) for d in dirs)


def _top_level_names(site_dir: Path) -> set[str]:
    names = set()
    for child in site_dir.iterdir():
        if child.name.endswith((".dist-info", ".egg-info", ".pth")) or child.name.startswith(("_aibro", "__pycache__")):
            continue
        if child.is_dir() or child.suffix in (".py", ".so", ".pyd"):
            names.add(child.name.split(".")[0])
    return names


def activate(site_dir: Path | None) -> list[str]:
    """Put a job's environment on sys.path in front of the worker's site-packages (None: nothing to do).

    Returns the top-level modules the environment provides that this process has already imported from
    elsewhere: those keep the worker's version for this job, so the caller should warn about them.
    """
    deactivate()
    if site_dir is None:
        return []
    before = list(sys.path)
    site.addsitedir(str(site_dir))  # also reads the packages' own .pth files
    added = [p for p in sys.path if p not in before]
    for p in added:
        sys.path.remove(p)
    # Right after the standard library: ahead of every site directory, never ahead of the stdlib itself.
    at = max((i + 1 for i, p in enumerate(sys.path) if p and _is_stdlib(p)), default=0)
    sys.path[at:at] = added
    _active[:] = added
    importlib.invalidate_caches()
    dirs = [os.path.realpath(p) for p in added]
    shadowed = []
    for name in sorted(_top_level_names(Path(site_dir))):
        mod = sys.modules.get(name)
        if mod is not None and not _under(getattr(mod, "__file__", None), dirs):
            shadowed.append(name)
    return shadowed


def _loaded_from(mod: object, dirs: list[str]) -> bool:
    origin = getattr(mod, "__file__", None) or getattr(getattr(mod, "__spec__", None), "origin", None)
    if origin:
        return _under(origin, dirs)
    paths = list(getattr(mod, "__path__", None) or [])  # a namespace package: only if wholly inside the env
    return bool(paths) and all(_under(p, dirs) for p in paths)


def deactivate() -> None:
    """Take the active environment off sys.path and forget every module loaded from it (no-op when none)."""
    if not _active:
        return
    dirs = [os.path.realpath(p) for p in _active]
    for p in _active:
        while p in sys.path:
            sys.path.remove(p)
        sys.path_importer_cache.pop(p, None)
    _active.clear()
    for name, mod in list(sys.modules.items()):
        if mod is not None and _loaded_from(mod, dirs):
            del sys.modules[name]
    importlib.invalidate_caches()


def worker_versions() -> dict[str, str]:
    """The worker's Python, TensorFlow and Keras versions, for aibro_core.requirements.version_mismatch."""
    return runtime_versions()
