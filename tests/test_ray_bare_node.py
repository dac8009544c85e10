"""Ray without a pre-install (issue 26 item 4): a node whose Python has Ray and TensorFlow but no aibro trains a
job. The node is started by `ray start` from a venv whose packages are a node image's (tests/wheelhouse.py
link_site: ray[default] and the agent's dependencies, not aibro); the backend ships its own agent in the job's
runtime_env (py_modules), and the agent on that node runs the shipped code, reporting the backend's own version."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import wheelhouse
from backend_proc import OwnBackend, own_backend
from ray_cluster import POOL, RayCluster, ray_available

from aibro_backend.providers import shipping
from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model, scratch
from helpers import slow_data

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def bare_bin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv with Ray and TensorFlow and no aibro: a node image's packages (this environment's Ray and the agent's
    dependencies, hard-linked: tests/wheelhouse.py link_site) on the venv's path, and the `ray` command pip writes."""
    with scratch(tmp_path_factory, "bare-node") as root:
        venv = root / "venv"
        env = {k: val for k, val in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER")}
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300, env=env)
        image = wheelhouse.link_site(["ray[default]", *shipping.AGENT_REQUIRES], root / "image")
        (site,) = venv.glob("lib/python3*/site-packages")
        (site / "node-image.pth").write_text(f"{image}\n")
        ray = venv / "bin" / "ray"
        ray.write_text(f"#!{venv}/bin/python\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
        ray.chmod(0o755)
        probe = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", "import aibro_backend"], capture_output=True)
        assert probe.returncode != 0, "the bare node's Python must not have aibro"
        yield venv / "bin"


@pytest.fixture(scope="module")
def cluster(bare_bin: Path) -> Iterator[RayCluster]:
    ray_available()
    c = RayCluster()
    try:
        c.head()  # the head runs no agent: only the bare node holds the aibro pool's resource
        c.node("bare", bin_dir=bare_bin)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def backend(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBackend]:
    home = tmp_path_factory.mktemp("ray-bare") / "home"
    with own_backend(home, "--provider", "ray", "--ray-address", cluster.address, "--ray-node-resource", POOL) as b:
        yield b


def _agent(instance_id: str) -> tuple[list[str], Path]:
    """The command line and working folder of this instance's agent process (found by its environment)."""
    marker = f"AIBRO_INSTANCE_ID={instance_id}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                cmd = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                if cmd[1:2] == [b"-I"]:  # the interpreter itself, not bubblewrap or setpriv around it
                    return [c.decode() for c in cmd], Path(os.readlink(proc / "cwd"))
        except OSError:
            continue
    return [], Path()


def test_a_node_without_aibro_trains_a_job_on_the_shipped_agent(backend: OwnBackend, bare_bin: Path) -> None:
    from aibro_backend.worker.version import agent_version

    client = backend.client()
    x, y = slow_data(300)
    job_id = (
        Training(client)
        .submit(FitRequest(make_model(), x, y, machine_ids="ray-cpu1", epochs=2, batch_size=32, cool_down_period_s=300))
        .job_id
    )
    deadline = time.monotonic() + 900
    while client.job(job_id).status not in (v.COMPLETED, v.CANCELED):
        assert time.monotonic() < deadline, client.job(job_id)
        time.sleep(0.5)
    job = client.job(job_id)
    assert job.status == v.COMPLETED and job.epochs_done == 2, job
    cmd, workdir = _agent(job.instance_id)  # cooling: the agent still runs
    assert cmd and Path(cmd[0]).parent == bare_bin, cmd
    roots = cmd[4:]
    assert roots and all("runtime_resources" in r for r in roots), f"the agent runs the shipped code: {cmd}"
    assert f"agent {agent_version()}" in (workdir / "worker.log").read_text(), "the backend's own version"
