"""The "Cloud training" sidebar in a real JupyterLab in headless Chromium, with no kernel anywhere: a job started
from the CLI shows up and progresses, survives a page reload and a backend restart ("reconnecting", then live),
is canceled from its card (the backend says CANCELED; a cancel that cannot reach the server says so on the card);
a job that completes raises a notification; the instance cools with a countdown and is terminated from the
Instances tab. Final cards have no Cancel, and every element stays inside the sidebar at JupyterLab's default
width. Screenshots go to test-artifacts/, the gallery's ones to docs/screenshots/."""

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
from browser import (
    chromium_page,
    click_while_offline,
    close_connection_lost_dialog,
    gallery_shot,
    jupyterlab,
    open_sidebar,
    outside_their_box,
    text_contrast,
    wait_until,
)

from aibro_jupyter.client import BackendClient

from conftest import ARTIFACTS, make_model
from helpers import aibro_cli

# how many lines a text shows across (the rectangles of the range that holds it, by their tops)
LINES_OF = """(el, text) => {
  const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const at = n.data.indexOf(text);
    if (at >= 0) {
      const range = document.createRange();
      range.setStart(n, at);
      range.setEnd(n, at + text.length);
      return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
    }
  }
  return 0;
}"""


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


def _inside(page: Any, where: str) -> None:
    bad = outside_their_box(page, "#aibro-cloud-training", clip=".aibro-machine-scroll")
    assert not bad, f"{where}: elements outside their box at the default sidebar width: {bad}"


def _no_cancel_on_final_cards(page: Any) -> None:
    for card in page.locator(".aibro-job").all():
        if card.get_attribute("data-status") in ("COMPLETED", "CANCELED"):
            assert not card.locator(".aibro-cancel").is_visible(), f"Cancel on {card.get_attribute('data-job-id')}"


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
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-sidebar.log") as (url, token), chromium_page(2) as page:
        shot = ARTIFACTS / "sidebar-timeout.png"
        open_sidebar(page, url, token)
        assert page.locator(".jp-Notebook").count() == 0, "no notebook open"
        kernels = requests.get(f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10)
        assert kernels.status_code == 200 and kernels.json() == [], "no kernel: the sidebar stands alone"

        job_id = _start_job(aibro_home, job_files, 60, "sidebar cli job")
        first = wait_until(page, lambda: _epochs(page, job_id) >= 1 and _epochs(page, job_id), "epoch 1", 240, shot)
        grown = wait_until(page, lambda: _epochs(page, job_id) > first and _epochs(page, job_id), "growth", 120, shot)
        card = _card(page, job_id)
        assert card.locator(".aibro-job-state").inner_text() == "TRAINING · TRAINING", "status · substatus"
        assert "loss" in card.locator(".aibro-job-metrics").inner_text()
        meta = re.fullmatch(r"local-cpu · (\d+):(\d\d) · free", card.locator(".aibro-job-meta").inner_text())
        assert meta, card.locator(".aibro-job-meta").inner_text()
        page.wait_for_timeout(2500)
        later = re.fullmatch(r"local-cpu · (\d+):(\d\d) · free", card.locator(".aibro-job-meta").inner_text())
        assert later and int(later[1]) * 60 + int(later[2]) > int(meta[1]) * 60 + int(meta[2]), "elapsed time moves"
        shown = {e.get_attribute("data-job-id") for e in page.locator(".aibro-job").all()}
        assert shown == {j.job_id for j in client.jobs()}, "every job of the user has a card"
        drawn = int(card.locator(".aibro-sparkline-loss").get_attribute("data-points"))
        assert drawn >= grown, "one curve point per epoch seen"
        active = sum(j.status not in ("COMPLETED", "CANCELED") for j in client.jobs())
        assert page.locator(".aibro-statusbar").inner_text().startswith(f"☁ {active} training") and active >= 1
        assert page.locator(".aibro-tab[data-tab=jobs] .aibro-badge").inner_text() == str(active), "Jobs tab count"
        page.screenshot(path=str(ARTIFACTS / "sidebar-live.png"))
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
        card.locator(".aibro-copy").click()
        assert page.evaluate("navigator.clipboard.readText()") == f"%cloud_attach {job_id}"
        page.wait_for_timeout(1700)  # "Copied" goes back to the button's label
        _inside(page, "jobs, one training")
        gallery_shot(page.locator("#aibro-cloud-training"), "sidebar-jobs", until=card)

        page.context.set_offline(True)  # a cancel that cannot reach the server says so and can be tried again
        page.wait_for_selector(".aibro-connection[data-state=reconnecting]", timeout=60_000)
        click_while_offline(page, card.locator(".aibro-cancel"))
        note = card.locator(".aibro-job-note")
        wait_until(page, lambda: "cancel failed" in note.inner_text(), "the failed cancel on the card", 60, shot)
        assert "unreachable" in note.inner_text(), note.inner_text()
        assert card.locator(".aibro-cancel").inner_text() == "Cancel" and card.locator(".aibro-cancel").is_enabled()
        page.context.set_offline(False)
        page.wait_for_selector(".aibro-connection[data-state=live]", timeout=60_000)
        close_connection_lost_dialog(page)
        assert client.job(job_id).status == "TRAINING" and not client.job(job_id).cancel_requested

        page.reload()
        open_sidebar(page, url, token)
        after = wait_until(page, lambda: _epochs(page, job_id) >= grown and _epochs(page, job_id), "reload", 60, shot)
        assert after >= grown and _epochs(page, job_id) <= client.job(job_id).epochs_done

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
        assert client.job(job_id).status == "CANCELED", "the backend says CANCELED"
        assert not _card(page, job_id).locator(".aibro-job-note").inner_text(), "the earlier failure is gone"
        _no_cancel_on_final_cards(page)
        canceled = page.locator(".Toastify__toast", has_text=job_id).filter(has_text="was canceled")
        canceled.first.wait_for(timeout=30_000)
        counted = page.locator(".aibro-statusbar")
        wait_until(page, lambda: counted.inner_text().startswith(f"☁ {active - 1} training"), "the count to drop")

        short = _start_job(aibro_home, job_files, 2, "sidebar short job")
        page.wait_for_selector(".Toastify__toast >> text=/sidebar short job.*completed/", timeout=240_000)
        toast = page.locator(".Toastify__toast", has_text="sidebar short job").first
        toast.hover()  # a hovered toast stays (its auto-close pauses) while it is photographed
        page.wait_for_timeout(1000)
        assert toast.locator(".jp-toast-message").evaluate(LINES_OF, short) == 1, "the job id on one line"
        gallery_shot(toast, "notification", toasts=True)
        page.mouse.move(0, 0)
        assert _card(page, short).get_attribute("data-status") == "COMPLETED" and _epochs(page, short) == 2
        page.screenshot(path=str(ARTIFACTS / "sidebar-completed.png"))
        _no_cancel_on_final_cards(page)

        failing = _start_job(aibro_home, job_files, 2, "sidebar failing job", model="failing_model")
        page.wait_for_selector(".Toastify__toast >> text=/sidebar failing job.*failed/", timeout=240_000)
        assert client.job(failing).status == "CANCELED" and client.job(failing).error
        assert _card(page, failing).locator(".aibro-job-error").inner_text(), "the card says why it failed"
        _no_cancel_on_final_cards(page)
        _inside(page, "jobs, all ended, one failed")
        poor = [t for t in text_contrast(page, "#aibro-cloud-training") if t["ratio"] < 4.5]
        assert not poor, f"text that does not read against its background (WCAG AA): {poor}"

        page.context.set_offline(True)  # the browser loses the server while a job starts and ends
        page.wait_for_selector(".aibro-connection[data-state=reconnecting]", timeout=60_000)
        unseen = _start_job(aibro_home, job_files, 1, "sidebar unseen job")
        deadline = time.time() + 240
        while client.job(unseen).status != "COMPLETED" and time.time() < deadline:
            time.sleep(1)
        assert client.job(unseen).status == "COMPLETED"
        page.context.set_offline(False)
        page.wait_for_selector(".Toastify__toast >> text=/sidebar unseen job.*completed/", timeout=60_000)
        assert _card(page, unseen).get_attribute("data-status") == "COMPLETED"
        close_connection_lost_dialog(page)

        page.locator(".aibro-tab", has_text="Instances").click()
        row = page.locator(".aibro-instance[data-status=COOLING]").first
        row.wait_for(timeout=60_000)
        wait_until(page, lambda: "closes in 4:" in row.inner_text() or "closes in 5:" in row.inner_text(), "countdown")
        instance_id = row.get_attribute("data-instance-id")
        row = page.locator(f'.aibro-instance[data-instance-id="{instance_id}"]')
        steps = row.locator(".aibro-instance-steps").inner_text()
        assert re.search(r"LAUNCHING \d\d:\d\d:\d\d.*EXECUTING \d\d:\d\d:\d\d.*COOLING \d\d:\d\d:\d\d", steps, re.S), (
            steps
        )
        assert re.match(r"cooling since \d\d:\d\d:\d\d \(\d+:\d\d\)", row.locator(".aibro-instance-since").inner_text())
        assert row.locator(".aibro-instance-job").inner_text().endswith("· free"), "the job's cost: free on local"
        _inside(page, "instances")
        page.screenshot(path=str(ARTIFACTS / "sidebar-instances.png"))
        gallery_shot(page.locator("#aibro-cloud-training"), "sidebar-instances", until=page.locator(".aibro-instances"))
        row.locator(".aibro-terminate").click()
        wait_until(
            page,
            lambda: row.get_attribute("data-status") in ("CLOSING", "CLOSED") and not row.locator("button").count(),
            "the terminated instance to close",
            60,
            shot,
        )
        assert {i.id: i.status for i in client.instances()}[instance_id] in ("CLOSING", "CLOSED")

        page.locator(".aibro-tab", has_text="Machines").click()
        assert page.locator('.aibro-machine-table tr[data-machine-id="local-cpu"]').count() == 1
        assert page.locator('tr[data-machine-id="local-cpu"] .aibro-price').inner_text().startswith("free")
        _inside(page, "machines")
        kernels = requests.get(f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10)
        assert kernels.json() == [], "all of it without a kernel ever starting"
