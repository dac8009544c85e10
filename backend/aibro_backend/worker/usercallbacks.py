"""The job's callbacks, rebuilt on the worker from the spec the kernel wrote (aibro_jupyter/rebuildplan.py): a
Keras class or the user's own from the travelling code, its arguments decoded (functions imported from the
travelling code, file and folder arguments pointed into this job's folder), plus what comes back while it trains:
the files they write, uploaded as artifacts `files/...` each epoch, and the lines they print."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aibro_core.files import private_dir
from aibro_core.models import Callback, OwnCallback
from aibro_core.objectrefs import decode
from aibro_core.vocabulary import CWD_SLOT

SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class FileReturn:
    """The folders the callbacks write into, and what of them was already sent back."""

    root: Path
    bases: dict[str, str] = field(default_factory=dict)  # worker folder → the kernel-side folder it stands for
    _sent: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def changed(self) -> list[tuple[Path, str, str]]:
        """Files written or rewritten since the last call: (path, artifact name, path under its kernel folder)."""
        out = []
        for folder in sorted(self.bases):
            base = Path(folder)
            for path in sorted(p for p in base.rglob("*") if p.is_file()):
                stat = path.stat()
                key = (stat.st_size, stat.st_mtime_ns)
                if self._sent.get(path) == key:
                    continue
                self._sent[path] = key
                rel = path.relative_to(base).as_posix()
                slot = base.relative_to(self.root).as_posix()
                parts = [_safe(part) for part in rel.split("/")]
                if len(parts) <= 5:  # an artifact name has at most 8 parts: files/<callback>/<argument>/...
                    out.append((path, "/".join(["files", slot, *parts]), rel))
        return out

    def working_directory(self, kernel_cwd: str | None) -> contextlib.AbstractContextManager[Any]:
        """Where the job's code runs: a folder of its own whose files come back to the kernel's working directory
        (a callback that saves `generated_img_0.png` leaves it next to the notebook, as locally); with no
        kernel-side directory, where the worker is."""
        if not kernel_cwd:
            return contextlib.nullcontext()
        folder = private_dir(self.root / CWD_SLOT)
        self.bases[str(folder)] = kernel_cwd
        return _inside(folder)

    def to_kernel(self, text: str) -> str:
        """A printed line with this worker's folders replaced by the kernel-side paths they stand for."""
        for folder, kernel in self.bases.items():
            text = text.replace(folder, kernel)
        return text


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _safe(part: str) -> str:
    """One part of a file's path as an artifact name allows it: letters, digits, '.', '_', '-', not leading '.'."""
    part = SAFE_CHARS.sub("_", part)[:128]
    return part if part[:1].isalnum() or part[:1] == "_" else "_" + part[:127]


def build_callbacks(specs: list[Callback], files: FileReturn) -> list[Any]:
    """The job's callbacks, made here with the arguments the user gave (a known callback's checked config holds
    only those: Keras' own defaults apply to the rest)."""
    import keras

    built = []
    for i, spec in enumerate(specs):
        source = importlib.import_module(spec.module) if isinstance(spec, OwnCallback) else keras.callbacks
        cls = getattr(source, spec.cls)
        config = spec.config if isinstance(spec.config, dict) else spec.config.model_dump(exclude_unset=True)
        built.append(cls(**{k: decode(v, files, f"{i}/{k}") for k, v in config.items()}))
    return built


def compile_again(model: Any, args: dict[str, Any]) -> Any:
    """A model whose class overrides compile() gets its own arguments again (Keras' load skipped that compile)."""
    model.compile(**{k: decode(val, None, f"compile/{k}") for k, val in args.items()})
    return model


class LineWriter(io.TextIOBase):
    """A stdout that hands on each complete line (what the user's callbacks print), in order."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self.emit(line)
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.emit(self._partial)
            self._partial = ""


def snapshot(path: Path, scratch: Path) -> Path:
    """A copy of a file a callback wrote, so a rewrite next epoch cannot race its upload."""
    private_dir(scratch)
    copy = scratch / f"{len(list(scratch.iterdir()))}-{path.name}"
    shutil.copyfile(path, copy)
    return copy
