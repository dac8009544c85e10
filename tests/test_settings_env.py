"""AIBRO_* settings are typed and validated (issue 25 item 4): a backend started with wrong values names every one,
with its value and its rule, and does not start; right values and defaults are what the backend then uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aibro_backend.scheduling.policy import Policy
from aibro_backend.server.limits import Limits
from aibro_core.envsettings import SettingsError

pytestmark = pytest.mark.fast


def test_a_backend_with_wrong_settings_names_them_all_and_does_not_start(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AIBRO_MAX_ACTIVE_JOBS": "abc",
        "AIBRO_MAX_ATTEMPTS": "-1",
        "AIBRO_IDLE_TIMEOUT_S": "0",
        "AIBRO_JOB_MAX_OPEN_FILES": "many",
    }
    done = subprocess.run(
        [sys.executable, "-m", "aibro_backend", "--home", str(tmp_path / "home"), "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    for named in ("AIBRO_MAX_ACTIVE_JOBS='abc'", "AIBRO_MAX_ATTEMPTS='-1'", "AIBRO_IDLE_TIMEOUT_S='0'"):
        assert named in done.stderr, done.stderr
    assert "AIBRO_JOB_MAX_OPEN_FILES='many'" in done.stderr, done.stderr
    assert not (tmp_path / "home" / "backend.json").exists(), "nothing started"


def test_values_and_defaults() -> None:
    policy = Policy.from_env({"AIBRO_MAX_ACTIVE_JOBS": " 7 ", "AIBRO_SPARE_WORKER": "yes", "AIBRO_ALLOW_UNSAFE": ""})
    assert (policy.max_active_jobs, policy.spare_worker, policy.allow_unsafe) == (7, True, "none")
    limits = Limits.from_env(policy, {"AIBRO_MAX_STORED_BYTES": "1000"})
    assert limits.max_stored_bytes == 1000 and limits.max_partial_bytes == 2 * policy.max_job_bytes
    with pytest.raises(SettingsError, match=r"AIBRO_MAX_COOL_DOWN_S='inf'.*finite"):
        Policy.from_env({"AIBRO_MAX_COOL_DOWN_S": "inf"})
