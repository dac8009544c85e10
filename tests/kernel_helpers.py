"""Drive a real IPython kernel through jupyter_client and collect what a notebook would show."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager


def digits_setup(tile: int = 1, then: str = "") -> str:
    """A kernel's set-up cell: the digits split 1400 / rest (x_train tiled `tile` times for longer epochs), `build()`
    for a small compiled model, then `then`, then `%load_ext aibro_jupyter`."""
    return f"""
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, keras
from sklearn.datasets import load_digits
d = load_digits()
x = (d.data / 16.0).astype("float32"); y = d.target.astype("int32")
x_train, y_train = np.tile(x[:1400], ({tile}, 1)), np.tile(y[:1400], {tile})
x_val, y_val = x[1400:], y[1400:]
keras.utils.set_random_seed(0)
def build():
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
{then}
%load_ext aibro_jupyter
"""


TUNE_SETUP = digits_setup(
    then="""
import keras_tuner as kt
def build_model(hp):
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(hp.Int("units", 8, 64, step=8), activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer=keras.optimizers.Adam(hp.Choice("learning_rate", [1e-2, 1e-3])),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m
"""
)  # the set-up cell of a %%cloud_tune notebook: the digits and a KerasTuner build function over two hyperparameters


@dataclass
class CellResult:
    msg_id: str = ""
    stdout: str = ""
    error: str = ""
    data: list[dict[str, Any]] = field(default_factory=list)
    widgets: dict[str, dict[str, Any]] = field(default_factory=dict)  # comm id → the widget's opening state
    updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (comm id, changed traits) in order
    done: bool = False


def start_kernel(env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[KernelManager, Any]:
    """A real kernel, started in `cwd` (the notebook's folder) when given."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, **(env or {})}, **({"cwd": cwd} if cwd else {}))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def run_cell(kc: Any, code: str, timeout: float = 300, until: str | None = None) -> CellResult:
    """Execute `code`; return early (leaving it running) once `until` appears in stdout."""
    return drain(kc, CellResult(msg_id=kc.execute(code)), timeout, until)


def drain(kc: Any, res: CellResult, timeout: float = 300, until: str | None = None) -> CellResult:
    """Collect what the cell shows until it is idle (or `until` appears in stdout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open":
            res.widgets[content["comm_id"]] = content.get("data", {}).get("state", {})
        elif kind == "comm_msg" and content.get("data", {}).get("method") == "update":
            res.updates.append((content["comm_id"], content["data"].get("state", {})))
        if msg["parent_header"].get("msg_id") != res.msg_id:
            continue
        if kind == "stream":
            res.stdout += content["text"]
            if until and until in res.stdout:
                return res
        elif kind == "error":
            res.error += f"{content['ename']}: {content['evalue']}"
        elif kind in ("display_data", "execute_result"):
            res.data.append(content["data"])
        elif kind == "status" and content["execution_state"] == "idle":
            res.done = True
            return res
    raise AssertionError(f"cell did not finish in {timeout}s; output so far: {res.stdout[-2000:]} {res.error}")


def click(kc: Any, res: CellResult, description: str) -> None:
    """Press a button the cell displayed, the way the browser does: a `click` message on the widget's comm."""
    found = [
        cid
        for cid, st in res.widgets.items()
        if st.get("_model_name") == "ButtonModel" and st.get("description") == description
    ]
    assert found, f"no button {description!r} among {[st.get('description') for st in res.widgets.values()]}"
    msg = kc.session.msg(
        "comm_msg", {"comm_id": found[-1], "data": {"method": "custom", "content": {"event": "click"}}}
    )
    kc.shell_channel.send(msg)
