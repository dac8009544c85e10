"""A shared backend does not run its users' code unconfined unless its operator says so (issue 24 item 1): with
two users and no working sandbox (no bubblewrap on PATH), `serve` refuses to start and says how to fix it;
`--sandbox none` starts, with a banner on every start and in GET /health; the embedded single-user backend starts
unconfined and says so on screen once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from backend_proc import own_backend

from helpers import user_env

NO_BWRAP = "/nonexistent-bin"  # the backend runs by absolute path; only bwrap, setpriv, nvidia-smi come from PATH

pytestmark = pytest.mark.fast


def _serve(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A backend that must exit by itself (a refused start)."""
    return subprocess.run(
        [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0", *args],
        env=user_env(home, PATH=NO_BWRAP),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _add_user(home: Path, name: str) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "aibro_backend.server.accounts", "add-user", name, "--home", str(home)],
        env=user_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr


def test_two_users_and_no_sandbox_refuse_to_serve_unless_the_operator_says_none(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with own_backend(home, PATH=NO_BWRAP) as first:  # one user: it serves, unconfined, and says so
        health = requests.get(f"{first.url}/api/v1/health", headers=_auth(first.token), timeout=30).json()
        assert health["sandbox"] == "none" and "NOT sandboxed" in health["sandbox_warning"]
    _add_user(home, "bob")
    refused = _serve(home)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "2 users" in refused.stderr and "apt-get install bubblewrap" in refused.stderr
    assert "--sandbox none" in refused.stderr
    with own_backend(home, "--sandbox", "none", PATH=NO_BWRAP) as served:
        health = requests.get(f"{served.url}/api/v1/health", headers=_auth(served.token), timeout=30).json()
        assert health["sandbox"] == "none" and "every other user's data" in health["sandbox_warning"]
    assert "NOT sandboxed" in served.log.read_text()


def test_the_embedded_backend_says_once_that_jobs_run_unconfined(tmp_path: Path) -> None:
    home = tmp_path / "home"
    script = "from aibro_jupyter.training import connect; connect().health()"
    env = user_env(home, PATH=NO_BWRAP)
    try:
        runs = [
            subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
            for _ in range(2)
        ]
    finally:
        subprocess.run(
            [sys.executable, "-m", "aibro_jupyter.cli", "backend", "stop"], env=env, capture_output=True, timeout=120
        )
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert "run unconfined" in runs[0].stderr and "apt-get install bubblewrap" in runs[0].stderr
    assert "run unconfined" not in runs[1].stderr, "said once, not on every connection"


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_health_says_bwrap_where_it_confines(tmp_path: Path) -> None:
    import shutil

    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: the README's test command installs it (apt-get install bubblewrap)")
    with own_backend(tmp_path / "home") as backend:
        health = requests.get(f"{backend.url}/api/v1/health", headers=_auth(backend.token), timeout=30).json()
    assert health["sandbox"] == "bwrap" and "sandbox_warning" not in health, json.dumps(health)


def test_a_ray_nodes_sandbox_takes_the_backends_uid_base(tmp_path: Path) -> None:
    """A Ray node's actor has no backend settings: it is handed AIBRO_SANDBOX_UID_BASE (providers/ray.py's launch
    spec), and the sandbox it chooses with it gives each user's worker that base plus the user id."""
    from aibro_backend.providers.sandbox import UID_BASE, Sandbox

    box = Sandbox.choose(sys.executable, "bwrap", [], uid_base=UID_BASE + 50_000)
    assert box.drop_uid, "the test runs as root, as the README's test command does: the worker drops to a uid"
    assert box.uid_for(3) == UID_BASE + 50_003
    assert Sandbox.choose(sys.executable, "bwrap", []).uid_for(3) == UID_BASE + 3
