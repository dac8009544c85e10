"""The agent wheel the backend builds of itself (providers/shipping.py): what it holds, what it declares, and that
the same code always makes the same bytes while other code makes another version."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import tomllib

from aibro_backend import __version__
from aibro_backend.providers import shipping
from aibro_backend.worker import version

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parent.parent


def test_it_declares_what_the_agent_distribution_declares() -> None:
    declared = tomllib.loads((REPO / "backend" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert list(shipping.AGENT_REQUIRES) == declared


def test_it_holds_both_packages_and_runs_as_aibro_worker(tmp_path: Path) -> None:
    wheel = shipping.build(tmp_path)
    assert wheel.version.startswith(__version__ + "+") and wheel.filename.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel.path) as zf:
        names = zf.namelist()
        info = f"aibro_backend-{wheel.version}.dist-info"
        meta = zf.read(f"{info}/METADATA").decode()
        scripts = zf.read(f"{info}/entry_points.txt").decode()
        record = zf.read(f"{info}/RECORD").decode().splitlines()
    assert "aibro_backend/worker/agent.py" in names and "aibro_core/vocabulary.py" in names
    assert "aibro_backend/providers/aws_catalog.csv" in names, "package data travels too"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist")] == list(
        shipping.AGENT_REQUIRES
    )
    assert "aibro-worker = aibro_backend.worker.agent:main" in scripts
    assert len(record) == len(names)


def test_the_same_code_makes_the_same_bytes_and_other_code_another_version(tmp_path: Path) -> None:
    first, again = shipping.build(tmp_path / "a"), shipping.build(tmp_path / "b")
    assert (first.sha256, first.version) == (again.sha256, again.version)
    changed = tmp_path / "agent.py"
    changed.write_text("print('other code')\n")
    sources = [(n, changed if n == "aibro_backend/worker/agent.py" else p) for n, p in version.code_files()]
    assert version.version_of(sources) != first.version
    assert version.agent_version() == first.version, "an agent runs as the version the wheel of its code carries"
