"""The "Cloud training" sidebar, unchanged, with the Ray provider (issue 12 item 6): a real JupyterLab in headless
Chromium pointed at a backend served with `--provider ray` against a real Ray cluster on this host (a head and
one 1-CPU node). The Machines tab lists the cluster's machines beside local-cpu, a job started from the CLI on
ray-cpu1 gets its card and trains, and the Instances tab shows its instance on the Ray provider."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_proc import own_backend
from browser import chromium_page, jupyterlab, open_sidebar, wait_until
from ray_cluster import POOL, RayCluster, start_cluster

from conftest import ARTIFACTS, make_model
from helpers import aibro_cli, slow_data

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with start_cluster({"a": {}}) as c:
        yield c


def _tab(page: Any, name: str) -> None:
    page.locator("#aibro-cloud-training .aibro-tab", has_text=name).click()


def test_the_sidebar_shows_ray_machines_and_a_job_training_on_one(cluster: RayCluster, tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    home = tmp_path / "home"
    args = ("--provider", "ray", "--ray-address", cluster.address, "--ray-node-resource", POOL)
    files = {"model": tmp_path / "model.keras", "x": tmp_path / "x.npy", "y": tmp_path / "y.npy"}
    make_model().save(files["model"])
    x, y = slow_data(3000)
    np.save(files["x"], x)
    np.save(files["y"], y)
    env = {"AIBRO_HOME": str(home), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with (
        own_backend(home, *args) as backend,
        jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-ray.log") as (url, token),
        chromium_page() as page,
    ):
        shot = ARTIFACTS / "sidebar-ray-timeout.png"
        open_sidebar(page, url, token)
        _tab(page, "Machines")
        row = page.locator('.aibro-machine-table tr[data-machine-id="ray-cpu1"]')
        wait_until(page, lambda: row.count() == 1, "ray-cpu1 in the Machines tab", 60, shot)
        assert row.get_attribute("data-provider") == "ray" and "ray" in row.inner_text()
        assert page.locator('.aibro-machine-table tr[data-machine-id="local-cpu"]').count() == 1
        page.screenshot(path=str(ARTIFACTS / "sidebar-ray-machines.png"))

        out = aibro_cli(
            home, "fit", str(files["model"]), "--x", str(files["x"]), "--y", str(files["y"]), "--epochs", "8",
            "--machine", "ray-cpu1", "--description", "on the ray cluster", "--detach",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        job_id = re.search(r"(job-\S+) started on ray-cpu1", out.stdout)
        assert job_id, out.stdout
        job_id = job_id.group(1)
        _tab(page, "Jobs")
        card = page.locator(f'.aibro-job[data-job-id="{job_id}"]')

        def training() -> bool:
            return card.count() == 1 and card.locator(".aibro-job-state").inner_text() == "TRAINING · TRAINING"

        wait_until(page, training, "the Ray job training in its card", 300, shot)
        assert card.locator(".aibro-job-meta").inner_text().startswith("ray-cpu1 · ")
        page.screenshot(path=str(ARTIFACTS / "sidebar-ray-job.png"))
        instance_id = backend.client().job(job_id).instance_id
        _tab(page, "Instances")
        inst = page.locator(f'.aibro-instance[data-instance-id="{instance_id}"]')
        wait_until(page, lambda: inst.count() == 1, "the Ray instance in the Instances tab", 60, shot)
        assert inst.locator(".aibro-instance-machine").inner_text() == "ray-cpu1 · ray"
        assert inst.get_attribute("data-status") == "EXECUTING"
        page.screenshot(path=str(ARTIFACTS / "sidebar-ray-instances.png"))
        backend.client().cancel(job_id)
