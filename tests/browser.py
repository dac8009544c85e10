"""A real JupyterLab server and Debian's headless Chromium driven by Playwright, for the browser tests; and the
page checks they share: layout (every element inside its box), text contrast, and the screenshot gallery that
docs/gallery.md shows (written to docs/screenshots/ by the tests themselves, so it always shows this code)."""

from __future__ import annotations

import json
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
_ROOT = Path(__file__).resolve().parent.parent
# The committed gallery is rewritten only on purpose (AIBRO_GALLERY=1): a plain test run leaves the checkout clean.
GALLERY = _ROOT / ("docs/screenshots" if os.environ.get("AIBRO_GALLERY") == "1" else "test-artifacts/gallery")
GALLERY_MAX_BYTES = 400_000
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
def chromium_page(scale: float = 1) -> Iterator[Any]:
    """A page in headless Debian Chromium (never a downloaded browser); `scale` 2 makes sharp screenshots."""
    if not Path(CHROMIUM).exists():
        raise AssertionError(f"{CHROMIUM} is missing: install Debian's browser with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=scale)
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


def jupyterlab_settings(root: Path, theme: str) -> dict[str, str]:
    """User settings for `jupyterlab(env=...)` that start JupyterLab in `theme` ("JupyterLab Dark", ...)."""
    path = root / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"theme": theme}))
    return {"JUPYTERLAB_SETTINGS_DIR": str(root)}


def gallery_shot(target: Any, name: str, until: Any = None, toasts: bool = False) -> Path:
    """Screenshot `target` (a page or a locator) into docs/screenshots/NAME.png for docs/gallery.md; with
    `until` (a locator inside it), only down to that element's bottom, so a tall sidebar's blank end is left out.
    Notifications are hidden from the picture unless `toasts` (they would cover what it shows)."""
    GALLERY.mkdir(parents=True, exist_ok=True)
    path = GALLERY / f"{name}.png"
    style = "" if toasts else ".Toastify__toast-container, .Toastify__toast { visibility: hidden !important; }"
    if until is None:
        target.screenshot(path=str(path), style=style)  # not animations="disabled": it ends a toast's timer
    else:
        top, end = target.bounding_box(), until.bounding_box()
        height = min(top["height"], end["y"] + end["height"] - top["y"] + 8)
        clip = {"x": top["x"], "y": top["y"], "width": top["width"], "height": height}
        target.page.screenshot(path=str(path), clip=clip, style=style)
    assert path.stat().st_size < GALLERY_MAX_BYTES, f"{path} is {path.stat().st_size} bytes: shoot a smaller part"
    return path


_OUTSIDE_JS = """
([root, clip]) => {
  const box = document.querySelector(root).getBoundingClientRect();
  const bad = [];
  const name = e => e.tagName.toLowerCase() + (e.className && typeof e.className === 'string'
    ? '.' + e.className.trim().split(/\\s+/).join('.') : '') + ` "${(e.textContent || '').trim().slice(0, 40)}"`;
  for (const e of document.querySelectorAll(root + ' *')) {
    const r = e.getBoundingClientRect();
    if (!r.width || !r.height || e.closest(clip) && !e.matches(clip)) continue;
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5) {
      const span = (q) => `${q.left.toFixed(0)}..${q.right.toFixed(0)}`;
      bad.push(`${name(e)} spans x ${span(r)}, outside ${span(box)}`);
    }
    if (e.matches('button') && (e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1)) {
      bad.push(`${name(e)}: its text overflows it (${e.scrollWidth}x${e.scrollHeight} in ` +
        `${e.clientWidth}x${e.clientHeight})`);
    }
    if (e.matches('button, .aibro-line')) {
      const range = document.createRange();
      range.selectNodeContents(e);
      const rects = Array.from(range.getClientRects()).filter(q => q.width > 0).sort((a, b) => a.top - b.top);
      let lines = 0, bottom = -Infinity;
      for (const q of rects) {
        if (q.top >= bottom - 1) { lines += 1; bottom = q.bottom; } else { bottom = Math.max(bottom, q.bottom); }
      }
      if (lines > 1) bad.push(`${name(e)}: wraps onto ${lines} lines`);
    }
  }
  return bad;
}
"""


def outside_their_box(page: Any, root: str, clip: str = "") -> list[str]:
    """Elements under `root` that stick out of it sideways, buttons whose text overflows them or wraps, and
    one-line texts (`.aibro-line`) that wrap. Descendants of `clip` (a box that scrolls its own content) are not
    looked at, the box itself is."""
    return page.evaluate(_OUTSIDE_JS, [root, clip or ":not(*)"])


_CONTRAST_JS = """
(root) => {
  const parse = s => {
    const m = s.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, under) => under.map((v, i) => v * (1 - top[3]) + top[i] * top[3]);
  const background = e => {
    const layers = [];
    for (let n = e; n; n = n.parentElement) {
      const c = parse(getComputedStyle(n).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    return layers.reverse().reduce((acc, c) => over(c, acc), [255, 255, 255]);
  };
  const lum = c => c.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
    .reduce((acc, v, i) => acc + v * [0.2126, 0.7152, 0.0722][i], 0);
  const out = [];
  for (const e of document.querySelectorAll(root + ', ' + root + ' *')) {
    const own = Array.from(e.childNodes).some(n => n.nodeType === 3 && n.textContent.trim());
    const r = e.getBoundingClientRect();
    if (!own || !r.width || !r.height) continue;
    const bg = background(e);
    const fg = over(parse(getComputedStyle(e).color), bg);
    const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
    out.push({ text: e.textContent.trim().slice(0, 40), cls: String(e.className), ratio: (hi + 0.05) / (lo + 0.05),
      fg: fg.map(Math.round), bg: bg.map(Math.round) });
  }
  return out;
}
"""


def text_contrast(page: Any, root: str) -> list[dict[str, Any]]:
    """For every visible element under `root` with text of its own: its WCAG contrast ratio (text colour over
    the background it is drawn on, transparency blended in), with the text, classes and both colours."""
    return page.evaluate(_CONTRAST_JS, root)


def close_connection_lost_dialog(page: Any) -> None:
    """JupyterLab's own "Server Connection Error" dialog, shown after the browser was offline: close it."""
    lost = page.locator(".jp-Dialog", has_text="Server Connection Error")
    if lost.count():
        lost.locator("button", has_text="Close").click()
        lost.wait_for(state="detached", timeout=10_000)


def click_while_offline(page: Any, target: Any, timeout: float = 60) -> None:
    """Click `target` while the browser is offline: JupyterLab's own "Server Connection Error" dialog may open at
    any moment then (its polls fail) and take the click, so close it and click again until the click lands."""
    deadline = time.monotonic() + timeout
    while True:
        close_connection_lost_dialog(page)
        try:
            target.click(timeout=3_000)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise


def open_sidebar(page: Any, url: str, token: str) -> None:
    """Open JupyterLab and the "Cloud training" sidebar at its default width, and wait until it is live."""
    page.goto(f"{url}/lab?token={token}")
    page.wait_for_selector(".jp-LabShell", timeout=120_000)
    tab = page.locator('.jp-SideBar [data-id="aibro-cloud-training"]')
    tab.wait_for(timeout=60_000)
    if not page.locator("#aibro-cloud-training").is_visible():
        tab.click()
    page.wait_for_selector("#aibro-cloud-training .aibro-connection[data-state=live]", timeout=60_000)
    dismiss_news_prompt(page)
