"""Drive a real IPython kernel through jupyter_client and collect what a notebook would show."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager


@dataclass
class CellResult:
    stdout: str = ""
    error: str = ""
    data: list[dict[str, Any]] = field(default_factory=list)


def start_kernel(env: dict[str, str] | None = None) -> tuple[KernelManager, Any]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, **(env or {})})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def run_cell(kc: Any, code: str, timeout: float = 300, until: str | None = None) -> CellResult:
    """Execute `code`; return early (leaving it running) once `until` appears in stdout."""
    msg_id = kc.execute(code)
    res = CellResult()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            res.stdout += content["text"]
            if until and until in res.stdout:
                return res
        elif kind == "error":
            res.error += f"{content['ename']}: {content['evalue']}"
        elif kind in ("display_data", "execute_result"):
            res.data.append(content["data"])
        elif kind == "status" and content["execution_state"] == "idle":
            return res
    raise AssertionError(f"cell did not finish in {timeout}s; output so far: {res.stdout[-2000:]} {res.error}")
