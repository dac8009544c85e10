"""The sidebar in JupyterLab's dark theme and then its light one, with more than one provider on offer (local and
AWS, the AWS side played by a moto server): every text reads against its background (WCAG contrast from the
computed styles), every element stays inside the sidebar at its default width, and the Machines table sorts by
price, GPU, vCPU, memory and availability with the prices in view. Screenshots go to docs/screenshots/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import numpy as np
import pytest
from aws_moto import make_account, moto_server, write_config  # noqa: E402
from backend_proc import OwnBackend, own_backend  # noqa: E402
from browser import (
    chromium_page,
    gallery_shot,
    jupyterlab,
    jupyterlab_settings,
    open_sidebar,
    outside_their_box,
    text_contrast,
    wait_until,
)
from test_browser_sidebar import _start_job  # noqa: E402

from conftest import ARTIFACTS, make_model  # noqa: E402
from helpers import user_env  # noqa: E402

SIDEBAR = "#aibro-cloud-training"
MIN_CONTRAST = 4.5  # WCAG AA for normal text


@pytest.fixture
def two_providers(tmp_path: Path) -> Iterator[OwnBackend]:
    """A backend serving the local machines and AWS's (moto) side by side."""
    with moto_server(realistic_spot=True) as aws_env:
        config = write_config(tmp_path / "aws.toml", make_account())
        with own_backend(tmp_path / "home", "--provider", "aws", "--aws-config", str(config), **aws_env) as backend:
            yield backend


def _readable(page: Any, where: str) -> None:
    texts = text_contrast(page, SIDEBAR)
    assert len(texts) > 5, f"{where}: the sidebar shows text"
    poor = {
        f"{t['cls']} {t['text']!r}: {t['ratio']:.2f} ({t['fg']} on {t['bg']})"
        for t in texts
        if t["ratio"] < MIN_CONTRAST
    }
    assert not poor, f"{where}: text that does not read against its background: {poor}"


def _every_column_reachable(page: Any) -> None:
    """At the sidebar's default width each column of the machines table shows, or the hint says to scroll and
    scrolling brings the last one fully into the box (by bounding boxes)."""
    scroll = page.locator(".aibro-machine-scroll")
    heads = page.locator(".aibro-machine-table th")

    def shown(i: int) -> bool:
        outer, head = scroll.bounding_box(), heads.nth(i).bounding_box()
        return outer["x"] - 1 <= head["x"] and head["x"] + head["width"] <= outer["x"] + outer["width"] + 1

    if not scroll.evaluate("e => e.scrollWidth > e.clientWidth + 1"):
        assert all(shown(i) for i in range(heads.count())), "every column inside the sidebar"
        return
    assert "Scroll sideways" in page.locator(".aibro-machines .aibro-hint").inner_text(), "a cut table says so"
    assert not shown(heads.count() - 1)
    scroll.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
    assert shown(heads.count() - 1), "scrolled to its end, the table shows its last column"
    scroll.evaluate("e => { e.scrollLeft = 0; }")


def _inside(page: Any, where: str) -> None:
    bad = outside_their_box(page, SIDEBAR, clip=".aibro-machine-scroll")
    assert not bad, f"{where}: elements outside their box at the default width: {bad}"


def _column(page: Any, index: int) -> list[str]:
    return page.locator(f".aibro-machine-table tr[data-machine-id] td:nth-child({index})").all_inner_texts()


def _price(text: str) -> float:
    first = text.split("\n")[0]
    return 0.0 if first == "free" else float(first.lstrip("<$"))


def _sorted_by(page: Any, label: str, index: int, key: Any) -> None:
    """Click a column header: ascending, click again: descending."""
    page.locator(".aibro-sort", has_text=re.compile(rf"^{re.escape(label)}")).click()
    values = [key(t) for t in _column(page, index)]
    assert values == sorted(values), f"{label} ascending: {values}"
    page.locator(".aibro-sort", has_text=re.compile(rf"^{re.escape(label)}")).click()
    values = [key(t) for t in _column(page, index)]
    assert values == sorted(values, reverse=True), f"{label} descending: {values}"


def _switch_theme(page: Any, theme: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Settings$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Theme$")).hover()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{theme}$")).click()


@pytest.mark.timeout(900)
def test_sidebar_reads_in_dark_and_light_theme_and_sorts_a_two_provider_marketplace(
    two_providers: OwnBackend, tmp_path: Path, digits
) -> None:  # noqa: ANN001
    ARTIFACTS.mkdir(exist_ok=True)
    home, client = two_providers.home, two_providers.client()
    x, y, _, _ = digits
    files = {"model": tmp_path / "model.keras", "x": tmp_path / "x.npy", "y": tmp_path / "y.npy"}
    make_model().save(files["model"])
    np.save(files["x"], x)
    np.save(files["y"], y)
    job_id = _start_job(home, files, 2, "a job shown in the dark theme")

    env = user_env(home, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    env.update(jupyterlab_settings(tmp_path / "lab-settings", "JupyterLab Dark"))
    with jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-theme.log") as (url, token), chromium_page(2) as page:
        shot = ARTIFACTS / "theme-timeout.png"
        open_sidebar(page, url, token)
        assert page.evaluate("document.body.dataset.jpThemeLight") == "false", "JupyterLab starts in its dark theme"
        card = page.locator(f'.aibro-job[data-job-id="{job_id}"]')
        wait_until(page, lambda: card.get_attribute("data-status") == "COMPLETED", "the job to complete", 300, shot)
        assert client.job(job_id).status == "COMPLETED"
        assert not card.locator(".aibro-cancel").is_visible(), "no Cancel on a completed job"
        assert card.locator(".aibro-job-meta").inner_text().endswith("· free"), "a local job costs nothing"
        _inside(page, "dark, jobs")
        _readable(page, "dark, jobs")
        gallery_shot(page.locator(SIDEBAR), "sidebar-jobs-dark", until=card)
        page.locator(".aibro-tab", has_text="Instances").click()
        page.locator(".aibro-instance[data-status=COOLING]").first.wait_for(timeout=60_000)
        _inside(page, "dark, instances")
        _readable(page, "dark, instances")

        page.locator(".aibro-tab", has_text="Machines").click()
        offers = {m.machine_id: m for m in client.machines()}
        assert {m.provider for m in offers.values()} >= {"local", "aws"}
        rows = page.locator(".aibro-machine-table tr[data-machine-id]")
        assert rows.count() == len(offers), "one row per offer"
        assert {r.get_attribute("data-provider") for r in rows.all()} >= {"local", "aws"}
        spot = page.locator('.aibro-machine-table tr[data-machine-id="g4dn.xlarge"] .aibro-price').inner_text()
        ondemand = page.locator('.aibro-machine-table tr[data-machine-id="g4dn.xlarge.od"] .aibro-price').inner_text()
        assert spot.endswith("spot") and ondemand.endswith("on-demand"), (spot, ondemand)
        assert (
            _price(spot) < _price(ondemand) and abs(_price(ondemand) - offers["g4dn.xlarge.od"].price_per_hour) < 0.006
        )
        prices = [_price(t) for t in _column(page, 2)]
        assert prices == sorted(prices), "sorted by price by default, cheapest first"
        box = page.locator(".aibro-machine-scroll").bounding_box()
        first_price = rows.first.locator(".aibro-price").bounding_box()
        assert first_price["x"] + first_price["width"] <= box["x"] + box["width"], "prices show without scrolling"
        _inside(page, "dark, machines")
        _every_column_reachable(page)
        _readable(page, "dark, machines")
        gallery_shot(page.locator(SIDEBAR), "sidebar-machines-dark", until=page.locator(".aibro-machine-scroll"))
        _sorted_by(page, "GPU", 3, lambda t: 0 if t == "–" else int(t.split("×")[0]))
        _sorted_by(page, "vCPU", 4, int)
        _sorted_by(page, "Mem", 5, lambda t: float(t.rstrip("G")))
        _sorted_by(page, "Avail", 6, lambda t: {"available": 0, "busy": 1}.get(t, 2))
        _sorted_by(page, "$/h", 2, _price)
        page.locator(".aibro-sort", has_text=re.compile(r"^\$/h")).click()  # cheapest first again

        _switch_theme(page, "JupyterLab Light")
        wait_until(page, lambda: page.evaluate("document.body.dataset.jpThemeLight") == "true", "light", 60, shot)
        page.wait_for_timeout(500)
        _inside(page, "light, machines")
        _readable(page, "light, machines")
        gallery_shot(page.locator(SIDEBAR), "sidebar-machines", until=page.locator(".aibro-machine-scroll"))
        page.locator(".aibro-tab", has_text="Jobs").click()
        _readable(page, "light, jobs")
        page.locator(".aibro-tab", has_text="Instances").click()
        _readable(page, "light, instances")
