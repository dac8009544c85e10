"""Run examples/quickstart.ipynb headless in a real kernel and print what each cell printed.

This is the README's main command: it trains a real model through %%cloud_fit on the embedded local backend."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def _chatter(line: str) -> bool:
    """TensorFlow's native start-up log lines, which the kernel forwards as stderr output."""
    return line.startswith(("I0000", "W0000", "E0000", "WARNING: All log messages before absl"))


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # the kernel inherits it: no TensorFlow start-up chatter
    path = Path(__file__).with_name("quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    log = Path(tempfile.gettempdir()) / "aibro-quickstart-kernel.log"
    with open(log, "w") as err:  # the kernel's own start-up chatter (TensorFlow, ZMQ) goes here, not on screen
        try:
            client.execute(stderr=err)
        except Exception:
            print(f"the notebook failed; the kernel's log is {log}", file=sys.stderr)
            raise
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                sys.stdout.write("".join(line for line in out["text"].splitlines(True) if not _chatter(line)))
            elif out.get("output_type") in ("execute_result", "display_data"):
                data = out.get("data", {})
                if "application/vnd.jupyter.widget-view+json" not in data and data.get("text/plain"):
                    print(data["text/plain"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
