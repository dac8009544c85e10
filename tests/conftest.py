"""Shared fixtures: an isolated AIBRO_HOME with a real embedded backend, small real data, small models."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Embedded backends started by tests keep no spare worker (one more TensorFlow process per backend on a 2-core box,
# and a spare's token is not in its /proc environ, where tests find a worker's token), whatever the outer shell says.
# tests/test_spare_worker.py turns it on for backends of its own.
os.environ["AIBRO_SPARE_WORKER"] = "0"

import numpy as np
import pytest

from aibro_backend.storage.store import Store
from aibro_jupyter import config
from aibro_jupyter.client import BackendClient

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def kill_workers(home: Path) -> None:
    """Kill any worker process whose work directory lives under `home` (left by SIGKILLed backends)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"AIBRO_WORKER_DIR={home}".encode() in env:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="session")
def wheels() -> Iterator[Path]:
    """One wheelhouse for the session, packed from this environment (tests/wheelhouse.py): the agent's
    dependencies but TensorFlow, which machine images have (`machine_site`); readable by every user (the SSH hosts'
    users install from it), removed at the end."""
    import wheelhouse

    from aibro_backend.providers.shipping import AGENT_REQUIRES

    root = Path(tempfile.mkdtemp(prefix="aibro-wheels-"))
    try:
        started = time.monotonic()
        wheelhouse.build(list(AGENT_REQUIRES), root, leave_out=("tensorflow",))
        print(f"\n[wheelhouse] packed in {time.monotonic() - started:.0f} s")
        os.chmod(root, 0o755)
        for whl in root.iterdir():
            os.chmod(whl, 0o644)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _image_parent() -> str | None:
    """Where a machine image's site-packages can hard-link this venv's files: the temp dir when it is on the same
    file system, else beside the venv (a copy of TensorFlow per image would be gigabytes)."""
    tmp = tempfile.gettempdir()
    return None if os.stat(tmp).st_dev == os.stat(sys.prefix).st_dev else sys.prefix


@pytest.fixture(scope="session")
def machine_site() -> Iterator[Path]:
    """The site-packages of the session's machine image: the agent's dependencies, TensorFlow included, as a
    machine image with TensorFlow has them (tests/wheelhouse.py link_site); machines without TensorFlow are
    played with stand-in wheels (tests/test_agent_install.py)."""
    import wheelhouse

    from aibro_backend.providers.shipping import AGENT_REQUIRES

    root = Path(tempfile.mkdtemp(prefix="aibro-image-", dir=_image_parent()))
    try:
        os.chmod(root, 0o755)
        yield wheelhouse.link_site(list(AGENT_REQUIRES), root / "site-packages")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def scratch(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A module fixture's folder, removed when its module is done (its backend logs judged first): machines' venvs
    and homes add up to gigabytes, and the disk CI runs on is not the suite's alone."""
    path = factory.mktemp(name)
    try:
        yield path
    finally:
        logs = backend_logs(path)
        _judged_logs.update(logs)
        _judged_findings.extend(unexpected_log_lines(logs, _every_pattern()))
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def aibro_home(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("aibro-home")
    old = {k: os.environ.pop(k, None) for k in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    os.environ["AIBRO_HOME"] = str(home)
    yield home
    config.stop_embedded()
    kill_workers(home)
    for k, val in old.items():
        if val is not None:
            os.environ[k] = val


@pytest.fixture(scope="session")
def client(aibro_home: Path) -> BackendClient:
    target = config.resolve()
    return BackendClient(target.url, target.token)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The backend's store on a database of the test's own, as a unit (no backend process)."""
    s = Store(tmp_path / "db.sqlite")
    yield s
    s.close()


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(x))
    x, y = x[idx], y[idx]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def make_model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.fixture
def model():
    return make_model()


# -- quiet logs: every WARNING/ERROR line a test's backend wrote is one a user should act on ----------------------
# Every backend log under the session's temporary directory is read: those under a test's own tmp_path (its
# own_backend's) right after that test, against its patterns only; the rest (the session's AIBRO_HOME/backend.log,
# module fixtures' backends) at the end, against every pattern. A test that provokes an actionable line on purpose
# says so with @pytest.mark.backend_log(r"regex", ...) (on the test or as a module's pytestmark); the lines below are
# provoked by tests that predate the marker, named by their module. Any other WARNING/ERROR line fails the session.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\S+) (WARNING|ERROR|CRITICAL) (.*)$")
BACKEND_LOG_MARK = "aibro backend listening on"
INVALID_BODY = r"tornado\.general WARNING .*Invalid body"  # tornado's own, for a malformed multipart body
EXPECTED_BY_MODULE: dict[str, list[str]] = {
    "test_api_inputs.py": [INVALID_BODY],
    "test_api_schema.py": [INVALID_BODY],
    "test_security.py": [INVALID_BODY, r"tornado\.access WARNING 403 GET /api/v1/worker/"],
    "test_enroll.py": [r"tornado\.access WARNING 401 POST /api/v1/worker/enroll"],
    "test_sandbox.py": [r"tornado\.access WARNING 403 POST /api/v1/jobs "],
    "test_scheduler_requests.py": [r"aibro\.scheduler (ERROR|WARNING) "],
    "test_aws_backend.py": [r"aibro\.aws WARNING ", r"aibro\.scheduler WARNING "],
    "test_aws_provider.py": [r"aibro\.aws WARNING "],
    "test_sandbox_policy.py": [r"aibro\.backend ERROR this backend has \d+ users"],
}
# Lines a user should act on wherever they come from: always allowed.
ACTIONABLE = [
    r"tornado\.access WARNING 40[13] .* refused",  # a refused token: someone holds a wrong, expired or revoked one
    r"tornado\.general WARNING SSL Error",  # a client that does not trust the backend's certificate
    r"aibro\.backend WARNING workers are NOT sandboxed",  # a backend serving unconfined says so on every start
    r"aibro\.backend WARNING (at the cap of|accept\(\) failed|AIBRO_MAX_CONNECTIONS)",
]
_expected_patterns: set[str] = set(ACTIONABLE)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backend_log(*patterns): WARNING/ERROR backend log lines (regexes) this test provokes on purpose"
    )


def _patterns_of(item: pytest.Item) -> set[str]:
    """What this test may leave in a backend log: its module's lines, its own marks, and ACTIONABLE."""
    patterns = set(ACTIONABLE) | set(EXPECTED_BY_MODULE.get(item.path.name, []))
    for mark in item.iter_markers("backend_log"):
        patterns.update(mark.args)
    return patterns


# Logs under a test's own tmp_path are judged right after it with that test's patterns only; the rest (the session's
# shared backend, module fixtures' backends) at the end with every pattern any test declared.
_judged_logs: set[Path] = set()
_judged_findings: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _expected_patterns.update(_patterns_of(item))
    yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if isinstance(tmp, Path):
        item.stash[_TEST_TMP] = tmp


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # its fixtures are finalized: its own backends have stopped and written their last lines
    tmp = item.stash.get(_TEST_TMP, None)
    if tmp is not None:
        logs = backend_logs(tmp)
        _judged_logs.update(logs)
        _judged_findings.extend(unexpected_log_lines(logs, _patterns_of(item)))
        if not item.stash.get(_FAILED, False):  # a passed test's folder goes now: some hold a gigabyte of blobs
            shutil.rmtree(tmp, ignore_errors=True)
    _note_disk()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


_TEST_TMP = pytest.StashKey[Path]()
_FAILED = pytest.StashKey[bool]()


def _every_pattern() -> set[str]:
    return _expected_patterns.union(*EXPECTED_BY_MODULE.values())


# The disk the suite takes: free space when the session starts and the least seen after any test, printed at the end.
_disk = {"start": shutil.disk_usage(tempfile.gettempdir()).free, "least": None}


def _note_disk() -> None:
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if _disk["least"] is None or free < _disk["least"]:
        _disk["least"] = free


def backend_logs(root: Path) -> list[Path]:
    """Every backend log under `root`: files ending in .log that a backend wrote (it says where it listens)."""
    found = []
    for path in sorted(root.rglob("*.log")):
        try:
            with open(path, errors="replace") as f:
                if BACKEND_LOG_MARK in f.read(1 << 16):
                    found.append(path)
        except OSError:
            continue
    return found


def unexpected_log_lines(paths: Iterable[Path], expected: Iterable[str]) -> list[str]:
    """The WARNING/ERROR/CRITICAL lines of these logs that match none of the expected regexes, as 'file: line'."""
    patterns = [re.compile(p) for p in expected]
    out = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = LOG_LINE.match(line)
            if m and not any(p.search(line) for p in patterns):
                out.append(f"{path}: {line}")
    return out


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n 2` (the README's test command) a module's tests stay on one worker, so its module fixtures start
    once; the Ray modules share one worker, so two clusters never start at once on the host. (xdist's own
    `--dist loadgroup` cannot say this under pytest 9: it renames node ids through a field pytest no longer reads,
    https://github.com/pytest-dev/pytest-xdist/issues/1386.)"""
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if "ray" in Path(module).stem else module

    return ModuleScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    factory = getattr(session.config, "_tmp_path_factory", None)
    lines = list(_judged_findings)
    controller = session.config.pluginmanager.getplugin("dsession") is not None  # xdist's: its workers judge
    if not controller and factory is not None and getattr(factory, "_basetemp", None) is not None:
        rest = [path for path in backend_logs(factory.getbasetemp()) if path not in _judged_logs]
        lines += unexpected_log_lines(rest, _expected_patterns)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports its findings and fails the session
        workeroutput["aibro_log_findings"] = lines
        workeroutput["aibro_disk"] = [_disk["start"], _disk["least"]]
        return
    lines += _from_workers
    session.config.stash[_LOG_FINDINGS] = lines
    if lines and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_from_workers: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker ended: its backend-log findings and the least free disk it saw come to the controller."""
    out = getattr(node, "workeroutput", {}) or {}
    _from_workers.extend(out.get("aibro_log_findings", []))
    start, least = out.get("aibro_disk", [None, None])
    if least is not None and (_disk["least"] is None or least < _disk["least"]):
        _disk["least"] = least


_LOG_FINDINGS = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    if _disk["least"] is not None:
        gib = 1 << 30
        terminalreporter.line(
            f"[disk] free at the start {_disk['start'] / gib:.1f} GiB, least free after a test "
            f"{_disk['least'] / gib:.1f} GiB: the suite took at most {(_disk['start'] - _disk['least']) / gib:.1f} GiB"
        )
    lines = config.stash.get(_LOG_FINDINGS, [])
    if lines:
        terminalreporter.section("backend log: WARNING/ERROR lines no test expected", sep="=", red=True)
        for line in lines[:50]:
            terminalreporter.line(line)
        terminalreporter.line(
            f"{len(lines)} line(s). Make the backend quieter where nothing needs acting on, or mark a test that "
            "provokes them on purpose with @pytest.mark.backend_log(r'regex')."
        )
