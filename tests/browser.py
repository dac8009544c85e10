"""A real JupyterLab server and Debian's headless Chromium driven by Playwright, for the browser tests."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyterlab(root: Path, env: dict[str, str], log: Path) -> Iterator[tuple[str, str]]:
    """Run `jupyter lab` on 127.0.0.1 with a random token and a fresh workspaces dir; yields (base url, token).

    The aibro server extension is not named here: it must be enabled by the package's own jupyter-config."""
    port, token = _free_port(), secrets.token_hex(16)
    workspaces = log.parent / f"workspaces-{port}"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={token}",
        f"--LabApp.workspaces_dir={workspaces}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/api/status", params={"token": token}, timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not start; its log:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def chromium_page() -> Iterator[Any]:
    """A page in headless Debian Chromium (never a downloaded browser)."""
    if not Path(CHROMIUM).exists():
        raise AssertionError(f"{CHROMIUM} is missing: install Debian's browser with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        finally:
            browser.close()


def wait_until(page: Any, cond: Any, what: str, timeout: float = 240, shot: Path | None = None) -> Any:
    """Poll `cond` while the page runs; on timeout keep a screenshot and say what never happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        page.wait_for_timeout(250)
    if shot is not None:
        page.screenshot(path=str(shot))
    raise AssertionError(f"timed out waiting for {what}" + (f" (screenshot in {shot})" if shot else ""))


def dismiss_news_prompt(page: Any) -> None:
    """JupyterLab asks once whether to fetch news; answer No so toasts and screenshots stay ours."""
    no = page.locator(".jp-toast-button", has_text="No")
    if no.count():
        no.first.click()


def wait_kernel_idle(page: Any, timeout_ms: float = 120_000) -> None:
    """The status bar says the notebook's kernel is Idle: only then is it safe to run cells."""
    page.wait_for_selector(".jp-StatusBar-Widget >> text=/Idle/", timeout=timeout_ms)
