"""Run examples/quickstart.ipynb headless in a real kernel, printing what each cell prints as it prints it.

This is the README's main command: it trains a real model through %%cloud_fit on the embedded local backend,
one "Epoch k/N" line as each epoch ends, and says at the end that the backend it started keeps running. Before each
cell it says what the cell is about to do (the cell's `aibro.narration` metadata): the panels a notebook shows are
widgets, which a terminal cannot draw."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

from aibro_jupyter import config
from aibro_jupyter.firstrun import embedded_note


def _chatter(line: str) -> bool:
    """TensorFlow's native start-up log lines, should any still reach the kernel's output."""
    return line.startswith(("I0000", "W0000", "E0000", "WARNING: All log messages before absl"))


class StreamingClient(NotebookClient):
    """A NotebookClient that prints each cell's text output the moment the kernel sends it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._partial = ""

    def output(self, outs: list, msg: dict[str, Any], display_id: str | None, cell_index: int) -> Any:
        out = super().output(outs, msg, display_id, cell_index)
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "stream" and content.get("name") == "stderr":  # a cell's warnings: the terminal's stderr
            sys.stderr.write("".join(line for line in content.get("text", "").splitlines(True) if not _chatter(line)))
            sys.stderr.flush()
        elif kind == "stream":
            self._write(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = content.get("data", {})
            if "application/vnd.jupyter.widget-view+json" not in data and data.get("text/plain"):
                self._write(data["text/plain"] + "\n")
        return out

    async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any, **kwargs: Any) -> Any:
        narration = cell.get("metadata", {}).get("aibro", {}).get("narration")
        if narration:
            self.flush_partial()
            print(f"\n» {narration}", flush=True)
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    def flush_partial(self) -> None:
        """Print a last line that had no newline."""
        if self._partial and not _chatter(self._partial):
            print(self._partial, flush=True)
        self._partial = ""

    def _write(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not _chatter(line):
                print(line, flush=True)


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # the kernel inherits it
    path = Path(__file__).with_name("quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = StreamingClient(
        nb,
        timeout=900,
        kernel_name="python3",
        # native writes to fd 2 go to the kernel's log below, not into the cells' output
        extra_arguments=["--IPKernelApp.capture_fd_output=False"],
        resources={"metadata": {"path": str(path.parent)}},
    )
    config.home().mkdir(parents=True, exist_ok=True, mode=0o700)
    logs = config.home() / "logs"
    logs.mkdir(exist_ok=True, mode=0o700)
    log = logs / "quickstart-kernel.log"
    print(f"» starting a Python kernel for {path.name} (its log: {log})…", flush=True)
    with open(log, "w") as err:  # the kernel's own start-up chatter (TensorFlow, ZMQ) goes here, not on screen
        try:
            client.execute(stderr=err)
        except Exception:
            print(f"the notebook failed; the kernel's log is {log}", file=sys.stderr)
            raise
    client.flush_partial()
    note = embedded_note()
    if note:
        print(f"\n{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
