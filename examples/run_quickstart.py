"""Run examples/quickstart.ipynb headless in a real kernel and print what each cell printed.

This is the README's main command: it trains a real model through %%cloud_fit on the embedded local backend."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main() -> int:
    path = Path(__file__).with_name("quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                sys.stdout.write(out["text"])
            elif out.get("output_type") in ("execute_result", "display_data"):
                text = out.get("data", {}).get("text/plain", "")
                if text and "Widget" not in text and not text.startswith(("VBox(", "HBox(")):
                    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
