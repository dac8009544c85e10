"""Imports run one way: the notebook package -> the shared core <- the backend and the worker. The worker must
install on a bare host, so neither the backend nor the core may import the notebook stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_STACK = ("aibro_jupyter", "IPython", "ipywidgets", "bqplot", "jupyter_server", "jupyterlab", "ipykernel")


def _imports(package_dir: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_backend_and_worker_never_import_the_notebook_package() -> None:
    bad = {f: n & set(NOTEBOOK_STACK) for f, n in _imports(ROOT / "backend" / "aibro_backend").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_core_imports_neither_side() -> None:
    bad = {f: n & {"aibro_backend", *NOTEBOOK_STACK} for f, n in _imports(ROOT / "backend" / "aibro_core").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_notebook_package_never_imports_the_backend() -> None:
    bad = {f: n & {"aibro_backend"} for f, n in _imports(ROOT / "aibro_jupyter").items()}
    assert not {f: n for f, n in bad.items() if n}
