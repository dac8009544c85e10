"""How the worker agent reaches a machine, in one place. The local provider runs it from the backend's own Python
(`agent_argv` without code roots); a cloud machine downloads the wheel built here (`served`, GET /worker/agent,
checked against the SHA-256 its user data names), never a name from a package registry; a Ray node gets the
backend's packages in the job's runtime_env (`ray_runtime_env`) and runs them from there (`code_roots`).

The wheel holds `aibro_backend` and `aibro_core` exactly as this backend runs them, and declares the agent's
third-party needs (AGENT_REQUIRES, which pip takes from the machine's image when present). Its version is the
backend's plus a digest of the code (`0.1.0+3f2a…`), so an agent built from other code never passes for this one;
the same code always makes the same bytes (sorted entries, fixed times), so a machine can cache it by hash.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

import aibro_backend
import aibro_core

from ..worker.version import code_files, version_of

# backend/pyproject.toml's dependencies, which tests/test_agent_wheel.py keeps equal to these
AGENT_REQUIRES = (
    "numpy",
    "packaging>=23",
    "pydantic>=2",
    "requests>=2.28",
    "tensorflow>=2.16",
    "keras>=3.3",
    "tensorboard",
)
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
WHEEL = b"Wheel-Version: 1.0\nGenerator: aibro-backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


@dataclass(frozen=True)
class AgentWheel:
    path: Path
    version: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.path.name


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _metadata(version: str) -> str:
    lines = ["Metadata-Version: 2.1", "Name: aibro-backend", f"Version: {version}", "Requires-Python: >=3.10"]
    lines += [f"Requires-Dist: {req}" for req in AGENT_REQUIRES]
    lines.append("Summary: the aibro worker agent, as built by the backend that runs its jobs")
    return "\n".join(lines) + "\n"


def build(dest_dir: Path) -> AgentWheel:
    """Build the agent wheel into `dest_dir` (reused when this code's wheel is already there)."""
    sources = code_files()
    version = version_of(sources)
    path = Path(dest_dir) / f"aibro_backend-{version}-py3-none-any.whl"
    if not path.is_file():
        Path(dest_dir).mkdir(parents=True, exist_ok=True)
        info = f"aibro_backend-{version}.dist-info"
        files = [(name, p.read_bytes()) for name, p in sources]
        files += [
            (f"{info}/METADATA", _metadata(version).encode()),
            (f"{info}/WHEEL", WHEEL),
            (f"{info}/entry_points.txt", b"[console_scripts]\naibro-worker = aibro_backend.worker.agent:main\n"),
        ]
        record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files)
        files.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in files:
                entry = zipfile.ZipInfo(name, ZIP_TIME)
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(entry, data)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)
    data = path.read_bytes()
    return AgentWheel(path, version, hashlib.sha256(data).hexdigest(), len(data))


_served: dict[Path, AgentWheel] = {}


def served(home: Path) -> AgentWheel:
    """The wheel the backend of `home` serves, built once (into home/state/agent) at start-up, of the code it runs."""
    dest_dir = Path(home) / "state" / "agent"
    if dest_dir not in _served:
        _served[dest_dir] = build(dest_dir)
    return _served[dest_dir]


def tensorflow_pin(versions: dict[str, Any]) -> str | None:
    """The kernel's TensorFlow as `major.minor` from a job spec's `versions` ("2.20.0" -> "2.20"); None without one."""
    raw = versions.get("tensorflow") if isinstance(versions, dict) else None
    try:
        release = Version(raw).release if isinstance(raw, str) else ()
    except InvalidVersion:
        return None
    return f"{release[0]}.{release[1]}" if len(release) >= 2 else None


def install_script(agent: AgentWheel, where: str, fetch: str, tensorflow: str | None = None) -> str:
    """POSIX sh lines that install `agent` into `where`/venv unless that version is there already: `fetch` puts the
    wheel's bytes at "$part"; they are installed only if their SHA-256 is the agent's. The venv sees the machine's
    own packages, so TensorFlow comes from the image when it has it; when it has none, pip installs `tensorflow`
    (the launching job's kernel's major.minor, tensorflow_pin) rather than whatever is newest. What EC2 user data
    and the SSH provider run."""
    pin = ""
    if tensorflow is not None:
        if not re.fullmatch(r"[0-9]{1,4}\.[0-9]{1,4}", tensorflow):
            raise ValueError(f"tensorflow must be major.minor, got {tensorflow!r}")
        has_tf = "import importlib.util as u, sys; sys.exit(u.find_spec('tensorflow') is None)"
        pin = f"""  "$d/venv/bin/python" -c "{has_tf}" || pin="tensorflow~={tensorflow}.0"
"""
    return f"""d="{where}"; part="$d/{agent.filename}.part"; pin=""
if [ "$(cat "$d/agent-version" 2>/dev/null)" != "{agent.version}" ]; then
  mkdir -p "$d"
  {fetch}
  echo "{agent.sha256}  $part" | sha256sum -c --quiet - || {{ echo "aibro: not the agent served" >&2; exit 3; }}
  mv "$part" "$d/{agent.filename}"
  [ -x "$d/venv/bin/python" ] || python3 -m venv --system-site-packages "$d/venv"
{pin}  "$d/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$d/{agent.filename}" $pin
  echo "{agent.version}" > "$d/agent-version"
fi
"""


def ray_runtime_env() -> dict[str, Any]:
    """The runtime_env of the Ray bridge's job: the backend's two packages as py_modules (content-hashed, uploaded
    once, on the path of this job's actors), so a node needs Ray and TensorFlow, not aibro."""
    modules = [str(Path(m.__file__).resolve().parent) for m in (aibro_backend, aibro_core)]
    return {"py_modules": modules, "excludes": ["__pycache__", "*.pyc"]}


def code_roots() -> list[str]:
    """The folders this process's aibro_backend and aibro_core come from (on a Ray node: the shipped code)."""
    return list(dict.fromkeys(str(Path(m.__file__).resolve().parents[1]) for m in (aibro_backend, aibro_core)))


# the agent from code beside the interpreter rather than installed in it: the folders holding aibro_backend and
# aibro_core go first on sys.path, and -I still keeps PYTHONPATH and user site-packages out
_BOOT = "import runpy, sys; sys.path[0:0] = sys.argv[1:]; del sys.argv[1:]; runpy.run_module({!r}, run_name='__main__')"


def agent_argv(python: str, roots: list[str] | None = None, module: str = "aibro_backend.worker") -> list[str]:
    """The command that runs `module` of the agent: installed in `python`, or from `roots` (code_roots)."""
    if not roots:
        return [python, "-I", "-m", module]
    return [python, "-I", "-c", _BOOT.format(module), *roots]
