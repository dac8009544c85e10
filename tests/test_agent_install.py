"""The agent's install on a machine whose Python has no TensorFlow (shipping.install_script: what EC2 user data and
the SSH provider run, here as they run it, in sh with the machine's python3): pip installs the launching job's
kernel's TensorFlow major.minor, not whatever is newest. The wheelhouse holds two stand-in TensorFlow releases, so
the pin decides which one the agent gets."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from aibro_backend.providers import shipping

MACHINE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a login shell's PATH on a Debian machine: its own python3


def _stand_in_tensorflow(dest: Path, version: str) -> None:
    """A wheel named tensorflow at `version` whose module says its version (and is nothing else)."""
    info = f"tensorflow-{version}.dist-info"
    files = {
        "tensorflow/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: tensorflow\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    with zipfile.ZipFile(dest / f"tensorflow-{version}-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)


@pytest.fixture(scope="module")
def house(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's wheelhouse with its TensorFlow replaced by stand-ins 2.19.0 and 2.99.0."""
    found = subprocess.run(
        ["python3", "-c", "import importlib.util as u; print(u.find_spec('tensorflow') is None)"],
        env={"PATH": MACHINE_PATH},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "True", "this test needs a machine python3 without TensorFlow (Debian's has none)"
    dest = tmp_path_factory.mktemp("tf-house")
    for whl in wheels.iterdir():
        if not whl.name.startswith("tensorflow-"):
            os.symlink(whl, dest / whl.name)
    for version in ("2.19.0", "2.99.0"):
        _stand_in_tensorflow(dest, version)
    return dest


def _install(tmp: Path, house: Path, tensorflow: str | None) -> str:
    """Run the install script as a machine does; the TensorFlow version the agent's venv then imports."""
    agent = shipping.build(tmp / "built")
    where = tmp / "agent"
    script = "set -eu\n" + shipping.install_script(agent, str(where), f'cp "{agent.path}" "$part"', tensorflow)
    env = {"PATH": MACHINE_PATH, "HOME": str(tmp), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (where / "agent-version").read_text().strip() == agent.version
    got = subprocess.run(
        [str(where / "venv" / "bin" / "python"), "-c", "import tensorflow; print(tensorflow.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return got.stdout.strip()


def test_a_machine_without_tensorflow_gets_the_kernels_major_minor(house: Path, tmp_path: Path) -> None:
    """pip alone would take the newest stand-in (2.99.0): the job's 2.19 decides."""
    assert _install(tmp_path / "pinned", house, "2.19") == "2.19.0"


def test_the_pin_is_major_minor_or_refused() -> None:
    assert shipping.tensorflow_pin({"tensorflow": "2.20.1", "python": "3.11.7"}) == "2.20"
    assert shipping.tensorflow_pin({"tensorflow": "2.21.0rc1"}) == "2.21"
    assert shipping.tensorflow_pin({"python": "3.11.7"}) is None
    assert shipping.tensorflow_pin({"tensorflow": "not a version"}) is None
    agent = shipping.AgentWheel(Path("/x/aibro_backend-0-py3-none-any.whl"), "0", "0" * 64, 1)
    with pytest.raises(ValueError, match="tensorflow must be major.minor"):
        shipping.install_script(agent, "/opt/aibro", "true", '2.20"; rm -rf /; "')
