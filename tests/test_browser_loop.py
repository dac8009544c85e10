"""A %%cloud_fit cell whose fit runs in a loop, in a real JupyterLab in headless Chromium: each pass's job shows its
own panel in the one place the first was shown (the page holds one panel, not one per pass, and no widget error
from the panels closed behind it, before and after a reload), the cell's prints and each job's epoch lines read in
order, and the Detach button of a later pass's panel (shown by a display update) reaches the kernel and ends the
loop there.
Screenshots are kept in test-artifacts/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from browser import chromium_page, dismiss_news_prompt, jupyterlab, wait_kernel_idle, wait_until
from kernel_helpers import digits_setup

from aibro_jupyter.client import BackendClient

from conftest import ARTIFACTS

LOOP = """%%cloud_fit -m local-cpu -d '{description}'
for it in range(3):
    h = model.fit(xb[:{n}], yb[:{n}], epochs={epochs}, batch_size=16)
    print("PASS", it, len(h.epoch))"""


def _notebook(dest: Path) -> None:
    cells = [
        digits_setup(then="model = build()\nxb, yb = np.repeat(x_train, 6, axis=0), np.repeat(y_train, 6, axis=0)"),
        LOOP.format(description="browser loop", n=320, epochs=1),
        LOOP.format(description="browser loop detach", n=8400, epochs=6),
    ]
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": c.strip()}
            for c in cells
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (dest / "loop.ipynb").write_text(json.dumps(nb))


def _run_cell(page: Any, index: int) -> None:
    page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")


def _prompt(page: Any, index: int) -> str:
    return page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text()


def _output(page: Any, index: int) -> Any:
    return page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-OutputArea")


def _headers(page: Any, index: int) -> list[str]:
    """The headers of the panels the cell's output shows (drawn, not only in the page)."""
    js = "els => els.filter(e => e.offsetHeight > 0).map(e => e.innerText)"
    return _output(page, index).locator(".aibro-nb-header").evaluate_all(js)


def _open(page: Any, url: str, token: str) -> None:
    page.goto(f"{url}/lab/tree/loop.ipynb?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-NotebookPanel-toolbar >> text=Python 3", timeout=120_000)
    wait_kernel_idle(page)
    dismiss_news_prompt(page)


def _wait(page: Any, cond: Any, what: str, timeout: float = 240) -> Any:
    return wait_until(page, cond, what, timeout, shot=ARTIFACTS / "lab-loop-timeout.png")


@pytest.mark.timeout(900)
def test_a_looped_fit_shows_one_panel_per_job_in_one_place(
    aibro_home: Path, client: BackendClient, tmp_path: Path
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    _notebook(tmp_path)
    env = {"AIBRO_HOME": str(aibro_home), "TF_CPP_MIN_LOG_LEVEL": "2", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-loop.log") as (url, token), chromium_page() as page:
        _open(page, url, token)
        _run_cell(page, 0)
        _wait(page, lambda: re.search(r"\[\d+\]", _prompt(page, 0)), "the set-up cell", timeout=180)

        _run_cell(page, 1)
        _wait(page, lambda: "PASS 2 1" in _output(page, 1).inner_text(), "the loop's three passes")
        _wait(page, lambda: "CELL DONE" in _output(page, 1).locator(".aibro-nb-state").inner_text(), "CELL DONE")
        headers = _headers(page, 1)
        assert len(headers) == 1 and "fit 3 of this cell" in headers[0], headers
        text = "".join(_output(page, 1).locator("[data-mime-type='application/vnd.jupyter.stdout']").all_inner_texts())
        order = [m.group(0) for m in re.finditer(r"Epoch 1/1|PASS \d 1", text)]
        assert order == ["Epoch 1/1", "PASS 0 1", "Epoch 1/1", "PASS 1 1", "Epoch 1/1", "PASS 2 1"], text
        shown = _output(page, 1).inner_text()
        assert "Error displaying widget" not in shown and "model not found" not in shown.lower(), shown
        page.screenshot(path=str(ARTIFACTS / "lab-loop-done.png"))
        page.keyboard.press("Control+s")  # a reload restores the widgets the kernel still holds, emptied boxes too
        page.wait_for_timeout(1500)
        page.reload()
        _open(page, url, token)
        _wait(page, lambda: _headers(page, 1), "the last panel after a reload", timeout=120)
        assert len(_headers(page, 1)) == 1 and "fit 3 of this cell" in _headers(page, 1)[0], _headers(page, 1)
        assert "CELL DONE" in _output(page, 1).locator(".aibro-nb-state").inner_text()

        _run_cell(page, 2)
        _wait(page, lambda: any("fit 2 of this cell" in h for h in _headers(page, 2)), "the second pass's panel")
        assert len(_headers(page, 2)) == 1, "the second pass's panel took the first one's place"
        _output(page, 2).locator("button", has_text="Detach").click()
        _wait(page, lambda: "the cell stopped at its fit on line 2 (fit 2)" in _output(page, 2).inner_text(), "stop")
        state = _output(page, 2).locator(".aibro-nb-state").inner_text()
        assert "DETACHED" in state, state
        jobs = [j for j in client.jobs() if j.description == "browser loop detach"]
        assert len(jobs) == 2 and jobs[0].status == "COMPLETED", jobs
        page.screenshot(path=str(ARTIFACTS / "lab-loop-detached.png"))
        page.wait_for_timeout(3000)
        assert len([j for j in client.jobs() if j.description == "browser loop detach"]) == 2, "no third job"
        client.cancel(jobs[1].job_id)
