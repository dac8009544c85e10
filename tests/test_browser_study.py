"""A %%cloud_tune cell in a real JupyterLab in headless Chromium (issue 27 items 3, 4 and 6): while the study runs,
its panel shows the trials, each running trial's loss and the best so far, and the sidebar groups the trials under
the study; at the end the panel's table, best line and parallel coordinates agree with what the backend says of
the study, the table sorts by the objective, nothing is left to cancel, and the sidebar's group says the best trial.
Screenshots go to the gallery (docs/screenshots/ with AIBRO_GALLERY=1)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from browser import (
    chromium_page,
    gallery_shot,
    jupyterlab,
    outside_their_box,
    text_contrast,
    wait_kernel_idle,
    wait_until,
)
from kernel_helpers import TUNE_SETUP

from aibro_jupyter.client import BackendClient

from conftest import ARTIFACTS

TRIALS = 4


def _notebook(dest: Path) -> None:
    tune = (
        "%%cloud_tune -m local-cpu --parallel 2 -d 'digits width and rate'\n"
        f"tuner = kt.RandomSearch(build_model, objective='val_accuracy', max_trials={TRIALS}, seed=5, "
        f"directory={str(dest / 'kt')!r}, project_name='lab')\n"
        "tuner.search(x_train, y_train, epochs=4, validation_data=(x_val, y_val))\n"
        "print('BEST', tuner.get_best_hyperparameters()[0].values)"
    )
    cells = [
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": s}
        for s in (TUNE_SETUP, tune)
    ]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}
    (dest / "study.ipynb").write_text(json.dumps(nb))


def _panel(page: Any) -> Any:
    return page.locator(".aibro-nb-study").first


def _group(page: Any) -> Any:
    return page.locator("#aibro-cloud-training .aibro-study").first


def _lines(panel: Any, chart: str) -> int:
    """The lines bqplot draws in one of the panel's charts (SVG paths of class `line`), leaving out legend icons and
    the parallel coordinates' grey axis rules."""
    js = """els => els.filter(e => !e.closest('[class^="legend"]') && (e.getAttribute('d') || '').length
        && getComputedStyle(e).stroke !== 'rgb(189, 189, 189)').length"""
    return panel.locator(f".aibro-nb-{chart}-chart path.line").evaluate_all(js)


def _done(panel: Any) -> int:
    m = re.search(r"(\d+)/\d+ trials done", panel.locator(".aibro-nb-study-summary").inner_text())
    return int(m.group(1)) if m else 0


def _wait(page: Any, cond: Any, what: str, timeout: float = 400) -> Any:
    return wait_until(page, cond, what, timeout, shot=ARTIFACTS / "study-timeout.png")


@pytest.mark.timeout(900)
def test_the_study_panel_and_the_sidebar_group_follow_a_search(
    aibro_home: Path, client: BackendClient, tmp_path: Path
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    _notebook(tmp_path)
    env = {"AIBRO_HOME": str(aibro_home), "TF_CPP_MIN_LOG_LEVEL": "2", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-study.log") as (url, token), chromium_page() as page:
        page.set_viewport_size({"width": 1400, "height": 1500})  # the whole panel in one picture
        page.goto(f"{url}/lab/tree/study.ipynb?token={token}")
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
        wait_kernel_idle(page)
        tab = page.locator('.jp-SideBar [data-id="aibro-cloud-training"]')
        if not page.locator("#aibro-cloud-training").is_visible():
            tab.click()
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

        panel = _panel(page)
        _wait(page, lambda: panel.count() and _lines(panel, "loss") >= 1, "a running trial's loss in the panel")
        assert panel.locator(".aibro-nb-state").inner_text().startswith("RUNNING")
        assert panel.locator("button", has_text="Cancel").is_visible()
        _wait(page, lambda: _group(page).count() and _group(page).locator(".aibro-job").count() >= 1, "the group")
        study_id = _group(page).get_attribute("data-study-id")
        assert study_id and study_id in panel.locator(".aibro-nb-header").inner_text()
        _wait(page, lambda: "best val_accuracy" in _group(page).inner_text(), "a best trial in the sidebar group")
        _wait(page, lambda: _done(panel) >= 2, "two trials done in the panel")
        gallery_shot(panel, "study-running")
        page.screenshot(path=str(ARTIFACTS / "study-sidebar-running.png"))

        _wait(page, lambda: "CELL DONE" in panel.locator(".aibro-nb-state").inner_text(), "CELL DONE")
        study = client.t.json("GET", f"/studies/{study_id}")
        assert study["status"] == "COMPLETED" and len(study["trials"]) == TRIALS
        best = next(t for t in study["trials"] if t["trial_id"] == study["best_trial_id"])
        rows = panel.locator("tr[data-trial]")
        assert rows.count() == TRIALS, "one row per trial"
        assert panel.locator("tr.aibro-nb-best").get_attribute("data-trial") == best["trial_id"]
        summary = panel.locator(".aibro-nb-study-summary").inner_text()
        assert f"best val_accuracy {best['score']:.4f} (trial {best['trial_id']})" in summary, summary
        assert f"{TRIALS}/{TRIALS} trials done" in summary, summary
        completed = [t for t in study["trials"] if t["status"] == "COMPLETED"]
        assert _lines(panel, "coords") == len(completed), "one line per scored trial across the parallel axes"
        assert _lines(panel, "loss") == TRIALS and _lines(panel, "best") == 1
        for name in ("Cancel", "Detach"):
            assert not panel.locator("button", has_text=name).is_visible(), f"{name} on a COMPLETED study"
        assert f"BEST {best['values']}" in page.locator(".jp-OutputArea-output").all_inner_texts()[-1]

        panel.locator("select").select_option("val_accuracy")
        panel.locator(".widget-toggle-button", has_text="descending").click()
        by_score = [t["trial_id"] for t in sorted(completed, key=lambda t: -t["score"])]
        _wait(page, lambda: [r.get_attribute("data-trial") for r in rows.all()][: len(by_score)] == by_score, "sorted")
        gallery_shot(panel, "study-completed")

        group = _group(page)
        _wait(page, lambda: group.get_attribute("data-status") == "COMPLETED", "the group's COMPLETED")
        assert group.locator(".aibro-study-trials .aibro-job").count() == TRIALS, "every trial under its study"
        text = group.inner_text()
        assert f"best val_accuracy {best['score']:.4f} · trial {best['trial_id']}" in text, text
        assert not group.locator(".aibro-cancel-study").is_visible(), "nothing to cancel in a COMPLETED study"
        assert not group.locator("button", has_text=re.compile("^Cancel$")).first.is_visible()
        assert outside_their_box(page, "#aibro-cloud-training", clip=".aibro-machine-scroll") == []
        poor = [t for t in text_contrast(page, ".aibro-study") if t["ratio"] < 4.5]
        assert not poor, f"the study box's text does not read against its background (WCAG AA): {poor}"
        gallery_shot(page.locator("#aibro-cloud-training"), "sidebar-study-completed", until=group)
