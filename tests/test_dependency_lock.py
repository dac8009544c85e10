"""The test environment is pinned and CI installs what a newcomer installs (issue 22): the README's test command is
what `.ci/run` runs, it installs into a fresh venv under the lock, and the lock answers every requirement that
pyproject.toml states (a dependency added without `bash requirements/lock.sh` fails here, not on a newcomer's machine).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "test-lock.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The lock is resolved for this interpreter and platform (requirements/lock.sh): markers are judged as there.
LOCK_ENV = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux"}


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", readme.split("\n## ")[0], re.S)


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{LOCK.name}: {line!r} is not a pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def stated_requirements() -> list[tuple[str, Requirement]]:
    project = PYPROJECT["project"]
    stated = [("dependencies", r) for r in project["dependencies"]]
    stated += [(f"[{extra}]", r) for extra, reqs in project["optional-dependencies"].items() for r in reqs]
    stated += [("build-system", r) for r in PYPROJECT["build-system"]["requires"]]
    return [(where, Requirement(r)) for where, r in stated]


def test_the_readme_opens_with_two_commands_and_ci_runs_the_second_verbatim() -> None:
    main, tests = readme_commands()
    assert "examples/run_quickstart.py" in main
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f".ci/run must run the README's test command as written:\n{tests}"


def test_the_test_command_installs_into_a_fresh_venv_under_the_lock() -> None:
    _, tests = readme_commands()
    assert re.search(r"python3 -m venv --clear (\S+) && \. \1/bin/activate && ", tests), tests
    assert 'PIP_CONSTRAINT="$PWD/requirements/test-lock.txt" pip install' in tests, tests
    whole = "python -m pytest -q -n 2 tests"
    assert tests.endswith(whole), "the README's test command runs the whole suite"


def test_the_lock_pins_a_version_that_every_stated_requirement_accepts() -> None:
    pins = locked()
    wrong = []
    for where, req in stated_requirements():
        if req.marker is not None and not req.marker.evaluate(LOCK_ENV):
            continue
        name = canonicalize_name(req.name)
        if name not in pins:
            wrong.append(f"{where} {req}: not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            wrong.append(f"{where} {req}: the lock has {pins[name]}")
    assert not wrong, "run `bash requirements/lock.sh --upgrade-package NAME` (or without arguments):\n" + "\n".join(
        wrong
    )


def test_runtime_dependencies_state_a_tested_floor() -> None:
    """Every runtime dependency names the lowest version it was tested with (tests/try_newest.py --lowest)."""
    missing = [str(r) for w, r in stated_requirements() if w == "dependencies" and not _has_floor(r)]
    assert not missing, f"runtime dependencies without a lower bound: {missing}"


def _has_floor(req: Requirement) -> bool:
    return any(s.operator in (">=", "~=", "==") for s in req.specifier)


def test_this_run_is_in_the_environment_the_lock_describes() -> None:
    """What the suite runs under now is the lock's: CI cannot be green on versions a newcomer would not get."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a virtual environment: the README's test command makes one (run it as written)")
    from importlib.metadata import distributions

    pins = locked()
    drift = sorted(
        f"{d.metadata['Name']} {d.version} (lock: {pins[n]})"
        for d in distributions()
        if (n := canonicalize_name(d.metadata["Name"])) in pins and pins[n] != d.version
    )
    assert not drift, drift
