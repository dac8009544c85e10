"""What played machines install from, made of what this test environment has installed, with no package index: a
wheelhouse (each installed distribution packed back into a wheel, its files as its RECORD lists them) and an image's
site-packages (the installed files themselves, hard-linked: a machine image that has TensorFlow costs no disk)."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import re
import shutil
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LEFT_OUT = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")


def closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that `requirements` need, transitively (markers evaluated here, extras named
    in a requirement followed)."""
    found: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        dist = found.setdefault(name, metadata.distribution(req.name))
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for raw in dist.requires or []:
                sub = Requirement(raw)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    todo.append(sub)
    return sorted(found.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def repack(dist: metadata.Distribution, dest: Path) -> Path:
    """Pack an installed distribution back into a wheel in `dest` (files outside site-packages, such as console
    scripts that pip writes again from entry_points.txt, are left out)."""
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
    info = next(f for f in dist.files or [] if f.name == "METADATA").parent.as_posix()
    wheel_meta = Path(str(dist.locate_file(f"{info}/WHEEL"))).read_text()
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    tag = "-".join(".".join(sorted({t[i] for t in tags})) for i in range(3))  # py2-none-any, py3-... -> py2.py3-...
    out = dest / f"{name}-{dist.version}-{tag}.whl"
    if out.exists():
        return out
    record = []
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for rel in sorted(dist.files or [], key=str):
            arc = rel.as_posix()
            if arc.startswith("..") or "__pycache__" in arc or (arc.startswith(info) and rel.name in LEFT_OUT):
                continue
            path = Path(str(dist.locate_file(rel)))
            if not path.is_file():
                continue
            zf.write(path, arc)
            record.append(f"{arc},{_hash(path)},{path.stat().st_size}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    tmp.rename(out)
    return out


def build(requirements: list[str], dest: Path, leave_out: tuple[str, ...] = ()) -> list[Path]:
    """Wheels for `requirements` and what they need, but for the distributions named in `leave_out`."""
    dest.mkdir(parents=True, exist_ok=True)
    skip = {canonicalize_name(n) for n in leave_out}
    return [repack(d, dest) for d in closure(requirements) if canonicalize_name(d.metadata["Name"]) not in skip]


def link_site(requirements: list[str], dest: Path) -> Path:
    """A site-packages folder holding `requirements` and what they need, as installed here: each file hard-linked
    (copied where links cannot reach), so the machines of a run share one TensorFlow on disk."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in closure(requirements):
        for rel in dist.files or []:
            arc = rel.as_posix()
            if arc.startswith("..") or "__pycache__" in arc:
                continue
            src = Path(str(dist.locate_file(rel)))
            if not src.is_file():
                continue
            out = dest / arc
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                continue
            try:
                os.link(src, out)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copy2(src, out)
    return dest
