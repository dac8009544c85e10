"""The quickstart in a real JupyterLab in headless Chromium: the panel and its curves grow while the job trains,
and a page reload mid-training still shows every epoch so far, live (the panel's state lives in the kernel, the
job's in the backend), then the final metrics, the result line and what the cell printed after the fit. The panel
says RUNNING while its cell runs (the status bar says Idle), its x-axis shows whole epochs, its legend sits outside
the plot, and a Detach click leaves it saying DETACHED. Screenshots are kept in test-artifacts/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from browser import (
    chromium_page,
    dismiss_news_prompt,
    gallery_shot,
    jupyterlab,
    jupyterlab_settings,
    text_contrast,
    wait_kernel_idle,
    wait_until,
)

from aibro_jupyter.client import BackendClient
from aibro_jupyter.widgets.style import SCROLL_ROWS

from conftest import ARTIFACTS

EPOCHS = 10
QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def _notebook(dest: Path) -> Path:
    """The quickstart, with ten times the data and ten epochs so there is time to reload mid-training."""
    nb = json.loads(QUICKSTART.read_text())
    fit = next(c for c in nb["cells"] if "%%cloud_fit" in "".join(c["source"]))
    source = "".join(fit["source"]).replace("epochs=8", f"epochs={EPOCHS}")
    assert f"epochs={EPOCHS}" in source, "the quickstart's fit cell changed: update this test"
    fit["source"] = source
    idx = nb["cells"].index(fit)
    grow = "x_train, y_train = np.repeat(x_train, 10, axis=0), np.repeat(y_train, 10, axis=0)\n"
    nb["cells"].insert(
        idx, {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": grow}
    )
    path = dest / "quickstart.ipynb"
    path.write_text(json.dumps(nb))
    return path


def _open(page: Any, url: str, token: str) -> None:
    page.goto(f"{url}/lab/tree/quickstart.ipynb?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-NotebookPanel-toolbar >> text=Python 3", timeout=120_000)
    wait_kernel_idle(page)


def _epochs_shown(page: Any) -> int | None:
    """The panel's epoch counter ("k/10"), or None while no panel is on the page."""
    labels = page.locator(".widget-label").all_inner_texts()
    done = [int(m.group(1)) for t in labels if (m := re.fullmatch(rf"(\d+)/{EPOCHS}", t.strip()))]
    return max(done) if done else None


def _curve_points(page: Any) -> list[int]:
    """Points of each curve the panel draws (bqplot renders a Lines mark as an SVG path; its legend icons are
    3-point paths too, inside a `legend<uuid>` group, and are left out)."""
    out = []
    js = "els => els.filter(e => !e.closest('[class^=\"legend\"]')).map(e => e.getAttribute('d') || '')"
    for d in page.locator(".bqplot path.line").evaluate_all(js):
        out.append(len(re.findall(r"[ML]", d)))
    return out


def _panel(page: Any, nth: int = 0) -> Any:
    return page.locator(".aibro-nb-panel").nth(nth)


def _tick_labels(page: Any) -> list[str]:
    """The tick labels of the first panel's x-axis: the bqplot axis group whose label is "epoch"."""
    js = """els => els.map(g => ({
        label: (g.querySelector('.axislabel') || {}).textContent || '',
        ticks: [...g.querySelectorAll('.tick text')].map(t => t.textContent.trim()),
    }))"""
    axes = _panel(page).locator(".bqplot g.axis").evaluate_all(js)
    found = [a["ticks"] for a in axes if a["label"].strip() == "epoch"]
    assert found, f"no epoch axis among {axes}"
    return found[0]


def _boxes_overlap(a: dict, b: dict) -> bool:
    return not (
        a["x"] + a["width"] <= b["x"]
        or b["x"] + b["width"] <= a["x"]
        or a["y"] + a["height"] <= b["y"]
        or b["y"] + b["height"] <= a["y"]
    )


def _check_chart(page: Any) -> None:
    """Whole epochs on the x-axis, each once; the legend outside the plot area."""
    ticks = _tick_labels(page)
    assert ticks and all(t.isdigit() for t in ticks), f"integer epoch ticks: {ticks}"
    assert len(ticks) == len(set(ticks)) and [int(t) for t in ticks] == sorted(int(t) for t in ticks), ticks
    assert [int(t) for t in ticks] == list(range(1, EPOCHS + 1)), f"every epoch of {EPOCHS} is a tick: {ticks}"
    panel = _panel(page)
    assert panel.locator(".bqplot [class^='legend']").count() == 0, "no legend drawn inside the plot"
    legend = panel.locator(".aibro-nb-legend").bounding_box()
    plot = panel.locator(".bqplot").first.bounding_box()
    assert legend and plot and not _boxes_overlap(legend, plot), f"the legend {legend} is outside the plot {plot}"


def _run_new_cell(page: Any, code: str) -> None:
    """Add a cell below the last one and run it, as a user does with the keyboard."""
    page.locator(".jp-NotebookPanel .jp-Cell").last.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    for i, line in enumerate(code.split("\n")):
        if i:
            page.keyboard.press("Enter")
            page.keyboard.press("Home")
        page.keyboard.type(line)
    page.keyboard.press("Shift+Enter")


def _snap(page: Any, name: str) -> None:
    """Screenshot with the panel in view and the news prompt out of the way."""
    dismiss_news_prompt(page)
    page.locator(".widget-label", has_text=re.compile(rf"^\d+/{EPOCHS}$")).first.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / name))


def _wait(page: Any, cond: Any, what: str, timeout: float = 240) -> Any:
    return wait_until(page, cond, what, timeout, shot=ARTIFACTS / "lab-timeout.png")


@pytest.mark.timeout(900)
def test_quickstart_panel_grows_and_survives_a_reload(aibro_home: Path, client: BackendClient, tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    _notebook(tmp_path)
    env = {"AIBRO_HOME": str(aibro_home), "TF_CPP_MIN_LOG_LEVEL": "2", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab.log") as (url, token), chromium_page() as page:
        _open(page, url, token)
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

        first = _wait(page, lambda: (_epochs_shown(page) or 0) >= 2 and _epochs_shown(page), "two epochs in the panel")
        grown = _wait(page, lambda: (_epochs_shown(page) or 0) > first and _epochs_shown(page), "the panel to grow")
        points = _curve_points(page)
        assert len(points) == 2 and min(points) >= grown - 1, f"train and validation curves grow: {points}"
        assert grown < EPOCHS, "the job finished before the reload: make the test's training longer"
        state = _panel(page).locator(".aibro-nb-state").inner_text()
        assert state.startswith("RUNNING") and "still running" in state and "Idle" in state, state
        _check_chart(page)
        _snap(page, "lab-before-reload.png")
        gallery_shot(_panel(page), "panel-running")
        job = next(j for j in reversed(client.jobs()) if j.description == "quickstart digits cnn")
        assert job.status == "TRAINING"

        page.keyboard.press("Control+s")  # what a user does before reloading: the output keeps the panel's view
        page.wait_for_timeout(1500)
        page.reload()
        _open(page, url, token)
        after = _wait(page, lambda: _epochs_shown(page), "the panel after the reload", timeout=120)
        assert after >= grown, "every epoch seen before the reload is still shown"
        done_now = client.job(job.job_id).epochs_done
        assert after >= min(done_now, EPOCHS) - 1, (after, done_now)
        _snap(page, "lab-after-reload.png")

        _wait(page, lambda: _epochs_shown(page) == EPOCHS, "the last epoch, live after the reload")
        _wait(
            page,
            lambda: (
                "<code>COMPLETED</code>" in page.content()
                or "COMPLETED" in " ".join(page.locator(".widget-html").all_inner_texts())
            ),
            "COMPLETED in the panel",
        )
        points = _curve_points(page)
        assert len(points) == 2 and min(points) == EPOCHS, f"every epoch on both curves after the reload: {points}"
        _wait(page, lambda: "CELL DONE" in _panel(page).locator(".aibro-nb-state").inner_text(), "CELL DONE")
        result = _panel(page).locator(".aibro-nb-result").inner_text()
        assert f"COMPLETED after {EPOCHS}/{EPOCHS} epochs" in result and "val_accuracy:" in result, result
        assert "final validation accuracy (evaluated in this kernel):" in result, "the after-fit output, reloaded"
        _check_chart(page)
        panel = _panel(page)
        for name in ("Cancel", "Detach"):
            assert not panel.locator("button", has_text=name).is_visible(), f"{name} on a COMPLETED panel"
        lines, fits = panel.locator(".aibro-nb-stepper").evaluate(
            "el => { const r = document.createRange(); r.selectNodeContents(el);"
            " const boxes = [...r.getClientRects()].filter(c => c.width > 0);"
            " const mids = boxes.map(c => (c.top + c.bottom) / 2), h = Math.max(...boxes.map(c => c.height));"
            " return [Math.max(...mids) - Math.min(...mids) < h / 2 ? 1 : 2, el.scrollWidth <= el.clientWidth + 1]; }"
        )
        assert (lines, fits) == (1, True), "the stepper reads on one line at the notebook's default width"
        outputs = " ".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "cuInit" not in outputs and "absl::InitializeLog" not in outputs, "no TensorFlow native lines"
        _snap(page, "lab-completed.png")
        gallery_shot(_panel(page), "panel-completed")
        final = client.job(job.job_id)
        assert final.status == "COMPLETED" and final.epochs_done == EPOCHS
        shown = dict(re.findall(r"(\w+): ([0-9.]+)", result.splitlines()[0]))
        last = final.history[
            -1
        ].model_dump()  # the History's last epoch, as the backend keeps it and the kernel gets it
        assert shown and {k: f"{last[k]:.4f}" for k in shown} == shown, (result, last)

        wait_kernel_idle(page)
        _run_new_cell(
            page, "%%cloud_fit -m local-cpu --cool-down 300 -d detach-in-lab\nmodel.fit(x_train, y_train, epochs=30)"
        )
        _wait(page, lambda: _panel(page, 1).count() and "/30" in _panel(page, 1).inner_text(), "the second panel")
        second = _panel(page, 1)
        assert second.locator(".aibro-nb-state").inner_text().startswith("RUNNING")
        second.locator("button", has_text="Detach").click()
        _wait(page, lambda: "DETACHED" in second.locator(".aibro-nb-state").inner_text(), "the panel saying DETACHED")
        state = second.locator(".aibro-nb-state").inner_text()
        assert "keeps training" in state and "%cloud_attach job-" in state, state
        assert second.locator("button", has_text="Detach").is_disabled()
        assert second.locator("button", has_text="Cancel").is_disabled()
        page.locator(".aibro-nb-panel").nth(1).scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "lab-detached.png"))
        detached = next(j for j in reversed(client.jobs()) if j.description == "detach-in-lab")
        assert client.job(detached.job_id).status in ("QUEUING", "TRAINING"), "Detach leaves the job going"
        client.cancel(detached.job_id)


LOOK_CELL = """
%load_ext aibro_jupyter
from aibro_core import vocabulary as v
from aibro_jupyter.progress import JobView
from aibro_core.models import Machine
from aibro_jupyter.widgets.picker import MachinePicker
from aibro_jupyter.widgets.progress_panel import ProgressPanel

def offer(mid, provider, price, gpus, vcpus, mem, spot, avail="available"):
    return Machine(machine_id=mid, provider=provider, gpu_count=gpus, gpu_type="T4" if gpus else None, vcpus=vcpus,
                memory_gib=mem, price_per_hour=price, spot=spot, availability=avail,
                on_demand_price_per_hour=0.526 if provider == "aws" else 0.0)

from aibro_core.models import Prediction
# a digits CNN's 20 epochs: two earlier runs on local-cpu measured, a FLOPs guess on the T4, nothing for the Ray GPU
predictions = [
    Prediction(machine_id="local-cpu", seconds=14 * 60, cost=0.0, source="history",
               basis="2 earlier jobs of this model on local-cpu: 1,510 samples/s over 38 epochs"),
    Prediction(machine_id="g4dn.xlarge", seconds=170.0, cost=0.0075, source="flops",
               basis="rough guess: 12.4 MFLOPs a sample at 20% of 8.1 TFLOP/s nominal (1x T4) and 4 ms a step"),
    Prediction(machine_id="g4dn.xlarge.od", seconds=170.0, cost=0.0248, source="flops",
               basis="rough guess: 12.4 MFLOPs a sample at 20% of 8.1 TFLOP/s nominal (1x T4) and 4 ms a step"),
    Prediction(machine_id="ray-gpu", seconds=None, cost=None, source=None,
               basis="nothing known: no earlier job of this model here, and no FLOPs or sample count to guess from"),
]
display(MachinePicker([
    offer("local-cpu", "local", 0.0, 0, 2, 8, False), offer("g4dn.xlarge", "aws", 0.158, 1, 4, 16, True),
    offer("g4dn.xlarge.od", "aws", 0.526, 1, 4, 16, False), offer("ray-gpu", "ray", 0.0, 1, 8, 32, False, "busy"),
], predictions=predictions))
import time
# 12 epochs of a digits CNN on a g4dn.xlarge spot machine ($0.158/h) for 2 min 30 s, as a real job reports them
view, panel = JobView("job-20261127-5f3a9c1e"), ProgressPanel("job-20261127-5f3a9c1e", "digits cnn", ["g4dn.xlarge"])
panel.started = time.time() - 150
logs = {}
for k in range(12):
    logs = {"accuracy": 0.99 - 0.55 / (k + 2) ** 1.3, "loss": 1.9 / (k + 1) ** 1.4,
            "val_accuracy": 0.985 - 0.5 / (k + 2) ** 1.3, "val_loss": 1.7 / (k + 1) ** 1.2}
    view.apply({"type": "epoch", "seq": k + 1, "data": {"epoch": k, "epochs": 12, "logs": logs}})
view.cost, view.price_per_hour = 0.158 * 150 / 3600, 0.158
view.apply({"type": "status", "seq": 20, "data": {"status": v.COMPLETED, "substatus": v.SUB_COMPLETED}})
panel.update(view)
with panel.after_fit():
    print(f"final validation accuracy (evaluated in this kernel): {logs['val_accuracy']:.4f}")
display(panel)
# a RandomSearch of 12 trials over a dense layer's width and the learning rate, as GET /studies/{id} answers it
from aibro_core.models import Study
from aibro_jupyter.widgets.study_panel import StudyPanel
trials = [{"trial_id": f"{i:02d}", "job_id": f"job-20261127-{i:08x}", "status": "COMPLETED", "message": None,
           "values": {"units": 8 * (i + 1), "learning_rate": [0.01, 0.001][i % 2]}, "score": 0.9 + (i % 5) / 100,
           "metrics": {}, "best_step": 3} for i in range(12)]
study = Study.model_validate({"study_id": "study-20261127-8d01e2aa", "status": "COMPLETED", "message": None,
    "description": "digits width and rate", "kind": "RandomSearch", "max_trials": 12, "parallel": 2,
    "objective": [{"name": "val_accuracy", "direction": "max"}], "created": time.time() - 640,
    "updated": time.time(), "cost": 0.0, "best_trial_id": "04", "trials": trials})
study_panel = StudyPanel(study.study_id, study.description)
study_panel.update(study, {})
display(study_panel)
"""


def _look_notebook(dest: Path) -> None:
    cell = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": LOOK_CELL}
    kernel = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb = {"cells": [cell], "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}
    (dest / "look.ipynb").write_text(json.dumps(nb))


def _poor_contrast(page: Any, root: str) -> set[str]:
    """HTML text under `root` (the chart's SVG text is bqplot's own) that reads below WCAG AA against its background."""
    texts = [t for t in text_contrast(page, root) if not t["cls"].startswith("[object SVG")]
    assert len(texts) > 10, f"{root} shows text"
    return {f"{t['cls']} {t['text']!r}: {t['ratio']:.2f} ({t['fg']} on {t['bg']})" for t in texts if t["ratio"] < 4.5}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("theme", ["JupyterLab Dark", "JupyterLab Light"])
def test_picker_and_panel_read_in_both_themes(
    aibro_home: Path, client: BackendClient, tmp_path: Path, theme: str
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    _look_notebook(tmp_path)
    env = {"AIBRO_HOME": str(aibro_home), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    env.update(jupyterlab_settings(tmp_path / "settings", theme))
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-look.log") as (url, token), chromium_page() as page:
        page.goto(f"{url}/lab/tree/look.ipynb?token={token}")
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
        wait_kernel_idle(page)
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        _wait(page, lambda: page.locator(".aibro-nb-study .aibro-nb-trials tbody tr").count(), "the panels")
        dismiss_news_prompt(page)
        dark = page.evaluate("document.body.dataset.jpThemeLight") == "false"
        assert dark == (theme == "JupyterLab Dark"), f"JupyterLab runs {theme}"
        for root in (".aibro-nb-picker", ".aibro-nb-panel"):  # the fit panel and the study panel
            poor = _poor_contrast(page, root)
            assert not poor, f"{theme}: text that does not read against its background in {root}: {poor}"
        heads = page.locator(".aibro-nb-picker .aibro-nb-head").all_inner_texts()
        assert [h.strip() for h in heads][:3] == ["machine", "provider", "GPU"], heads
        cells = [t.strip() for t in page.locator(".aibro-nb-picker .aibro-nb-cell").all_inner_texts()]
        for machine in ("local-cpu", "ray-gpu"):  # one price story with the sidebar and %cloud_machines
            at = cells.index(machine)
            assert cells[at + 5 : at + 7] == ["free", "free"], f"{machine} costs nothing: {cells[at : at + 8]}"
        local, ray = cells.index("local-cpu"), cells.index("ray-gpu")
        assert cells[local + 7 : local + 9] == ["14 min", "free"] and cells[ray + 7 : ray + 9] == ["—", "—"], cells
        tip = page.locator(".aibro-nb-picker .aibro-nb-cell span", has_text="14 min").get_attribute("title")
        assert tip.startswith("history: 2 earlier jobs of this model"), tip
        for head in page.locator(".aibro-nb-picker .aibro-nb-head button").all():
            assert head.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), f"a cramped header: {head.inner_text()}"
        assert page.locator(".aibro-nb-panel .aibro-nb-result pre").count() == 1, "the fit panel shows the result"
        cost = page.locator(".aibro-nb-panel:not(.aibro-nb-study) .widget-label", has_text="elapsed").inner_text()
        assert cost.startswith("cost $0.01 · elapsed"), cost
        table = page.locator(".aibro-nb-study .aibro-nb-trials")
        in_view, sizes = table.evaluate(
            "t => { const box = t.querySelector('.aibro-nb-scroll').getBoundingClientRect();"
            " const rows = [...t.querySelectorAll('tbody tr')];"
            " return [rows.filter(r => r.getBoundingClientRect().bottom <= box.bottom + 1).length,"
            " [box.height, t.querySelector('thead').getBoundingClientRect().height,"
            " ...rows.slice(0, 3).map(r => r.getBoundingClientRect().height)]]; }"
        )
        assert in_view == SCROLL_ROWS, f"the trials table shows {in_view} of 12 rows (box, head, rows: {sizes})"
        assert f"12 trials: {SCROLL_ROWS} in view, scroll the table for the other 4" in table.inner_text()
        name = theme.split()[-1].lower()
        fit_panel = page.locator(".aibro-nb-panel:not(.aibro-nb-study)")
        page.locator(".aibro-nb-picker").screenshot(path=str(ARTIFACTS / f"picker-{name}.png"))
        fit_panel.screenshot(path=str(ARTIFACTS / f"panel-{name}.png"))
        gallery_shot(page.locator(".aibro-nb-picker"), f"picker-{name}")
        gallery_shot(fit_panel, f"panel-{name}")
