"""The user's own code on the worker: the travelling sources unpacked into a folder of their own, put on the
import path for one job, imported so their Keras registrations run, and taken off again afterwards so the next
job on a warm worker starts clean (and can bring a new version of the same module)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from aibro_core.files import private_dir

PATH_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*){0,15}\.py")


class UserCode:
    """One job's travelling code: `activate()` before the model loads, `deactivate()` when the job ends."""

    def __init__(self, blob: Path, root: Path) -> None:
        manifest = json.loads(blob.read_text(encoding="utf-8"))
        files, modules = manifest.get("files"), manifest.get("modules")
        if not isinstance(files, dict) or not isinstance(modules, list):
            raise ValueError("the code blob is not a {files, modules} manifest")
        self.modules = [str(m) for m in modules]
        self.dir = root / blob.name
        if not self.dir.is_dir():
            tmp = root / (blob.name + ".part")
            for rel, src in files.items():
                if not isinstance(rel, str) or not PATH_RE.fullmatch(rel) or not isinstance(src, str):
                    raise ValueError(f"the code blob names a bad path {rel!r}")
                dest = tmp / rel
                private_dir(dest.parent)
                dest.write_text(src, encoding="utf-8")
            private_dir(tmp)
            tmp.rename(self.dir)
        self._before: set[str] = set()

    def activate(self) -> list[Any]:
        """Put the code first on the import path and import the modules the model names."""
        import importlib

        self._before = set(sys.modules)
        sys.path.insert(0, str(self.dir))
        importlib.invalidate_caches()
        loaded = []
        for name in self.modules:
            try:
                loaded.append(importlib.import_module(name))
            except ModuleNotFoundError as exc:
                missing = exc.name or str(exc)
                raise RuntimeError(
                    f"your code ({name}) imports '{missing}', which is not installed on the worker: add it to the "
                    f"job's requirements (requirements=['{missing.split('.')[0]}'] in online_fit, or "
                    f"%%cloud_fit --requirements {missing.split('.')[0]})"
                ) from None
        return loaded

    def deactivate(self) -> None:
        """Forget every module imported from the code folder, and the folder itself."""
        folder = str(self.dir)
        while folder in sys.path:
            sys.path.remove(folder)
        for name in list(sys.modules):
            if name in self._before:
                continue
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith(folder + "/"):
                del sys.modules[name]
