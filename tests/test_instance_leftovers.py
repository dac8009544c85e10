"""Issue 39 item 4, the leftovers, replayed: worker folders are made 0700 whatever the umask."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest


def _modes(root: Path) -> dict[str, str]:
    """Every folder under `root` (itself included) whose mode is not 0700, by its path below `root`."""
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
    modes = {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in folders}
    return {path: mode for path, mode in modes.items() if mode != "0o700"}


# -- 2. worker folders are made 0700 -------------------------------------------------------------------------------
WORKER_FOLDERS = """
import json, os, sys
from pathlib import Path

os.umask(0o022)  # what a worker started by hand, or a Ray node's, may run under before the agent's own umask
from aibro_backend.providers.sandbox import Sandbox
from aibro_backend.worker.agent import Worker
from aibro_backend.worker.usercallbacks import snapshot
from aibro_backend.worker.usercode import UserCode

root = Path(sys.argv[1])
Sandbox("none", sys.executable).prepare(root / "state" / "workers" / "inst-1", None)  # the provider's side
work = root / "state" / "workers" / "inst-1"
worker = Worker("http://127.0.0.1:9", "aibro_w_x", "inst-1", work)  # its cache and code folders
blob = worker.cache / ("1" * 64)
blob.write_text(json.dumps({"files": {"pkg/sub/mod.py": "X = 1\\n"}, "modules": ["pkg.sub.mod"]}))
UserCode(blob, worker.code_root)  # the job's code, unpacked in folders of its own
(work / "out.txt").write_text("a callback's file")
snapshot(work / "out.txt", work / "returning" / "epoch-1")  # a copy on its way back to the kernel
"""


@pytest.mark.fast
def test_worker_folders_are_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WORKER_FOLDERS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "state" / "workers" / "inst-1"
    assert (work / "code" / ("1" * 64) / "pkg" / "sub" / "mod.py").exists(), "the code was unpacked"
    assert _modes(tmp_path / "state") == {}, "every folder made on the way, on either side, is 0700"
