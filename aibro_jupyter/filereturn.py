"""Files the job's callbacks write on the worker (ModelCheckpoint, CSVLogger, TensorBoard, and whatever the job's
code writes into its working directory) → the kernel-side paths they name (the notebook's folder for the working
directory), each as it arrives, so the cell after the fit (or a cell run while it trains) can open them.

The kernel decided those paths when it submitted the job (the job view's `files`); the worker only says which
file of a slot it wrote. A name that is not what the callback would write there (a file pattern's fields filled
in, or anything under a log folder) is not written, so nothing a worker sends lands outside those paths."""

from __future__ import annotations

import re
import string
import warnings
from pathlib import Path
from typing import Any

from aibro_core import vocabulary as v
from aibro_core.models import CallbackFiles


def pattern_regex(name: str) -> re.Pattern[str]:
    """A file name pattern as Keras formats it (`best-{epoch:02d}-{val_loss:.2f}.keras`) → the names it can give."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(name):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(r"[^/]+")
    return re.compile("".join(parts))


def _plain_file(rel: str) -> bool:
    """What the job's code may leave in the notebook's folder: a data or picture file, not code, a notebook or a
    hidden file (a worker never rewrites what the kernel runs)."""
    parts = rel.split("/")
    return not any(part.startswith(".") for part in parts) and Path(rel).suffix.lower() not in CODE_SUFFIXES


CODE_SUFFIXES = frozenset({".py", ".pyc", ".pth", ".ipynb", ".sh", ".so", ".pyx"})


class FilesBack:
    """A watcher: downloads each file a callback wrote to where the kernel's callback would have written it."""

    def __init__(self, client: Any, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self._slots: dict[str, CallbackFiles] | None = None

    def __call__(self, view: Any, ev: dict[str, Any]) -> None:
        d = ev.get("data") or {}
        if ev.get("type") != v.EV_LOG or not d.get("file") or not isinstance(d.get("path"), str):
            return
        target = self.target(str(d["file"]), d["path"])
        if target is None:
            if str(d["file"]).startswith(f"files/{v.CWD_SLOT}/"):
                warnings.warn(
                    f"the job wrote {d['path']!r} in its working directory; code, notebooks and hidden files are not "
                    f"brought into the notebook's folder (the job's artifact {d['file']} holds it)",
                    stacklevel=2,
                )
                return
            warnings.warn(
                f"the worker sent back {d['path']!r}, which no callback of this job writes: ignored", stacklevel=2
            )
            return
        self.client.download_artifact(self.job_id, d["file"], target)

    def target(self, artifact: str, rel: str) -> Path | None:
        """Where `rel` of the artifact's slot goes in the kernel, or None when that slot would not write it."""
        if self._slots is None:
            self._slots = {f.slot: f for f in self.client.job(self.job_id).files}
        parts = artifact.split("/")
        slot = self._slots.get("/".join(parts[1:3])) if len(parts) > 3 and parts[0] == "files" else None
        if slot is None or rel.startswith("/") or ".." in rel.split("/"):
            return None
        kernel = Path(slot.kernel)
        if slot.slot == v.CWD_SLOT and not _plain_file(rel):
            return None
        if slot.kind == "dir":
            return kernel / rel
        if "/" in rel or not pattern_regex(kernel.name).fullmatch(rel):
            return None
        return kernel.parent / rel
