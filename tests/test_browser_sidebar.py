"""The "Cloud training" sidebar in a real JupyterLab in headless Chromium, with no kernel anywhere: a job started
from the CLI shows up and progresses, survives a page reload and a backend restart ("reconnecting", then live),
is canceled from its card (the backend says CANCELED); a job that completes raises a notification; the
instance cools with a countdown and is terminated from the Instances tab. Screenshots go to test-artifacts/."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import requests
from browser import chromium_page, dismiss_news_prompt, jupyterlab, wait_until

from aibro_jupyter.client import BackendClient

from conftest import ARTIFACTS, make_model
from helpers import aibro_cli


def _cli(home: Path, *args: str) -> str:
    out = aibro_cli(home, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _start_job(home: Path, files: dict[str, Path], epochs: int, description: str, model: str = "model") -> str:
    unsafe = ["--unsafe"] if model != "model" else []
    out = _cli(
        home, "fit", str(files[model]), "--x", str(files["x"]), "--y", str(files["y"]), "--epochs", str(epochs),
        "--machine", "local-cpu", "--cool-down", "300", "--description", description, "--detach", *unsafe,
    )  # fmt: skip
    m = re.search(r"(job-\S+) started on local-cpu", out)
    assert m, out
    return m.group(1)


def _card(page: Any, job_id: str) -> Any:
    return page.locator(f'.aibro-job[data-job-id="{job_id}"]')


def _epochs(page: Any, job_id: str) -> int:
    card = _card(page, job_id)
    if not card.count():
        return -1
    m = re.match(r"epoch (\d+)/", card.locator(".aibro-job-epochs").inner_text())
    return int(m.group(1)) if m else -1


def _open_sidebar(page: Any, url: str, token: str) -> None:
    page.goto(f"{url}/lab?token={token}")
    page.wait_for_selector(".jp-LabShell", timeout=120_000)
    tab = page.locator('.jp-SideBar [data-id="aibro-cloud-training"]')
    tab.wait_for(timeout=60_000)
    if not page.locator("#aibro-cloud-training").is_visible():
        tab.click()
    page.wait_for_selector("#aibro-cloud-training .aibro-connection[data-state=live]", timeout=60_000)
    dismiss_news_prompt(page)


@pytest.fixture
def job_files(tmp_path: Path, digits) -> dict[str, Path]:  # noqa: ANN001
    x, y, _, _ = digits
    files = {"model": tmp_path / "model.keras", "x": tmp_path / "x.npy", "y": tmp_path / "y.npy"}
    make_model().save(files["model"])
    np.save(files["x"], np.repeat(x, 8, axis=0))
    np.save(files["y"], np.repeat(y, 8, axis=0))
    files["failing_model"] = tmp_path / "failing.keras"  # fine in the kernel, fails on the worker as it loads
    failing = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Lambda(lambda t: t if not __import__("os").environ.get("AIBRO_WORKER_DIR") else [][0]),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    failing.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    failing.save(files["failing_model"])
    return files


@pytest.mark.timeout(900)
def test_sidebar_follows_a_cli_job_through_reload_and_backend_restart_and_cancels_it(
    aibro_home: Path, client: BackendClient, job_files: dict[str, Path], tmp_path: Path
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    env = {"AIBRO_HOME": str(aibro_home), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-sidebar.log") as (url, token), chromium_page() as page:
        shot = ARTIFACTS / "sidebar-timeout.png"
        _open_sidebar(page, url, token)
        assert page.locator(".jp-Notebook").count() == 0, "no notebook open"
        kernels = requests.get(f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10)
        assert kernels.status_code == 200 and kernels.json() == [], "no kernel: the sidebar stands alone"

        job_id = _start_job(aibro_home, job_files, 60, "sidebar cli job")
        first = wait_until(page, lambda: _epochs(page, job_id) >= 1 and _epochs(page, job_id), "epoch 1", 240, shot)
        grown = wait_until(page, lambda: _epochs(page, job_id) > first and _epochs(page, job_id), "growth", 120, shot)
        card = _card(page, job_id)
        assert card.locator(".aibro-job-state").inner_text() == "TRAINING · TRAINING", "status · substatus"
        assert "loss" in card.locator(".aibro-job-metrics").inner_text()
        meta = re.fullmatch(r"local-cpu · (\d+):(\d\d) · \$0\.00", card.locator(".aibro-job-meta").inner_text())
        assert meta, card.locator(".aibro-job-meta").inner_text()
        page.wait_for_timeout(2500)
        later = re.fullmatch(r"local-cpu · (\d+):(\d\d) · \$0\.00", card.locator(".aibro-job-meta").inner_text())
        assert later and int(later[1]) * 60 + int(later[2]) > int(meta[1]) * 60 + int(meta[2]), "elapsed time moves"
        shown = {e.get_attribute("data-job-id") for e in page.locator(".aibro-job").all()}
        assert shown == {j["job_id"] for j in client.jobs()}, "every job of the user has a card"
        drawn = int(card.locator(".aibro-sparkline-loss").get_attribute("data-points"))
        assert drawn >= grown, "one curve point per epoch seen"
        active = sum(j["status"] not in ("COMPLETED", "CANCELED") for j in client.jobs())
        assert page.locator(".aibro-statusbar").inner_text().startswith(f"☁ {active} training") and active >= 1
        page.screenshot(path=str(ARTIFACTS / "sidebar-live.png"))
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
        card.locator(".aibro-copy").click()
        assert page.evaluate("navigator.clipboard.readText()") == f"%cloud_attach {job_id}"

        page.reload()
        _open_sidebar(page, url, token)
        after = wait_until(page, lambda: _epochs(page, job_id) >= grown and _epochs(page, job_id), "reload", 60, shot)
        assert after >= grown and _epochs(page, job_id) <= client.job(job_id)["epochs_done"]

        before_restart = _epochs(page, job_id)
        with open(aibro_home / "start.lock", "w") as lock:  # hold restarts back so "reconnecting" stays visible
            fcntl.flock(lock, fcntl.LOCK_EX)
            pid = int(__import__("json").loads((aibro_home / "backend.json").read_text())["pid"])
            os.kill(pid, signal.SIGKILL)
            page.wait_for_selector(".aibro-connection[data-state=reconnecting]", timeout=60_000)
            assert "reconnecting" in page.locator(".aibro-connection").inner_text()
            page.screenshot(path=str(ARTIFACTS / "sidebar-reconnecting.png"))
            time.sleep(2)
            fcntl.flock(lock, fcntl.LOCK_UN)
        page.wait_for_selector(".aibro-connection[data-state=live]", timeout=90_000)
        wait_until(page, lambda: _epochs(page, job_id) > before_restart, "epochs after the backend restart", 120, shot)

        _card(page, job_id).locator(".aibro-cancel").click()
        wait_until(page, lambda: _card(page, job_id).get_attribute("data-status") == "CANCELED", "CANCELED", 60, shot)
        assert client.job(job_id)["status"] == "CANCELED", "the backend says CANCELED"
        page.wait_for_selector(f".Toastify__toast >> text=/{job_id}.*canceled/", timeout=30_000)
        counted = page.locator(".aibro-statusbar")
        wait_until(page, lambda: counted.inner_text().startswith(f"☁ {active - 1} training"), "the count to drop")

        short = _start_job(aibro_home, job_files, 2, "sidebar short job")
        page.wait_for_selector(".Toastify__toast >> text=/sidebar short job.*completed/", timeout=240_000)
        assert _card(page, short).get_attribute("data-status") == "COMPLETED" and _epochs(page, short) == 2
        page.screenshot(path=str(ARTIFACTS / "sidebar-completed.png"))

        failing = _start_job(aibro_home, job_files, 2, "sidebar failing job", model="failing_model")
        page.wait_for_selector(".Toastify__toast >> text=/sidebar failing job.*failed/", timeout=240_000)
        assert client.job(failing)["status"] == "CANCELED" and client.job(failing)["error"]
        assert _card(page, failing).locator(".aibro-job-error").inner_text(), "the card says why it failed"

        page.context.set_offline(True)  # the browser loses the server while a job starts and ends
        page.wait_for_selector(".aibro-connection[data-state=reconnecting]", timeout=60_000)
        unseen = _start_job(aibro_home, job_files, 1, "sidebar unseen job")
        deadline = time.time() + 240
        while client.job(unseen)["status"] != "COMPLETED" and time.time() < deadline:
            time.sleep(1)
        assert client.job(unseen)["status"] == "COMPLETED"
        page.context.set_offline(False)
        page.wait_for_selector(".Toastify__toast >> text=/sidebar unseen job.*completed/", timeout=60_000)
        assert _card(page, unseen).get_attribute("data-status") == "COMPLETED"
        lost = page.locator(".jp-Dialog", has_text="Server Connection Error")  # JupyterLab's own dialog
        if lost.count():
            lost.locator("button", has_text="Close").click()
            lost.wait_for(state="detached", timeout=10_000)

        page.locator(".aibro-tab", has_text="Instances").click()
        row = page.locator(".aibro-instance[data-status=COOLING]").first
        row.wait_for(timeout=60_000)
        wait_until(page, lambda: "closes in 4:" in row.inner_text() or "closes in 5:" in row.inner_text(), "countdown")
        instance_id = row.get_attribute("data-instance-id")
        page.screenshot(path=str(ARTIFACTS / "sidebar-instances.png"))
        row.locator(".aibro-terminate").click()
        wait_until(
            page,
            lambda: page.locator(f'.aibro-instance[data-instance-id="{instance_id}"]').count() == 0,
            "the terminated instance to go",
            60,
            shot,
        )
        assert {i["id"]: i["status"] for i in client.instances()}[instance_id] in ("CLOSING", "CLOSED")

        page.locator(".aibro-tab", has_text="Machines").click()
        assert page.locator('.aibro-machine-table tr[data-machine-id="local-cpu"]').count() == 1
        kernels = requests.get(f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10)
        assert kernels.json() == [], "all of it without a kernel ever starting"
