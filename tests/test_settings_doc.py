"""Every AIBRO_* setting is a field of its process's settings class, documented from it (issue 36 item 4): the README's
tables are the ones the classes write, every field says what it does, and a wrong value names its variable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aibro_backend.worker.settings import WorkerSettings
from aibro_core import settingsdoc
from aibro_core.envsettings import SettingsError
from aibro_jupyter.settings import KernelSettings

pytestmark = pytest.mark.fast

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_tables_are_the_ones_the_settings_classes_write() -> None:
    readme = README.read_text()
    assert settingsdoc.rewritten(readme) == readme, "run `python -m aibro_core.settingsdoc README.md`"


@pytest.mark.parametrize("dotted", settingsdoc.CLASSES)
def test_every_setting_says_what_it_does(dotted: str) -> None:
    cls = settingsdoc.settings_class(dotted)
    rows = settingsdoc.documented(cls)
    assert rows and all(variable == "AIBRO_" + name.upper() for name, variable, *_ in rows)
    silent = [name for name, _, _, _, doc in rows if not doc.strip()]
    assert not silent, f"{cls.__name__}: fields without a description: {silent}"


def test_the_kernel_names_a_wrong_value_and_where_to_fix_it() -> None:
    settings = KernelSettings.from_env({"AIBRO_BACKEND_URL": " https://b.example ", "AIBRO_NATIVE_LOGS": ""})
    assert (settings.backend_url, settings.native_logs, settings.spare_worker) == ("https://b.example", False, True)
    with pytest.raises(SettingsError, match=r"AIBRO_NATIVE_LOGS='loud': .*boolean.*notebook's environment"):
        KernelSettings.from_env({"AIBRO_NATIVE_LOGS": "loud"})


def test_the_worker_reads_its_settings_without_pydantic_and_names_a_wrong_value() -> None:
    settings = WorkerSettings.from_env({"AIBRO_WORKER_URL": "http://b:1", "AIBRO_SHUTDOWN_ON_LOSS": "1"})
    assert (settings.worker_url, settings.shutdown_on_loss, settings.backend_gone_s) == ("http://b:1", True, 900.0)
    with pytest.raises(SettingsError) as wrong:
        WorkerSettings.from_env({"AIBRO_BACKEND_GONE_S": "0", "AIBRO_CPU_DEVICES": "two"})
    assert "AIBRO_BACKEND_GONE_S='0': set a number greater than 0" in str(wrong.value)
    assert "AIBRO_CPU_DEVICES='two': set a whole number" in str(wrong.value)
    assert "secret" not in repr(WorkerSettings.from_env({"AIBRO_WORKER_TOKEN": "secret"}))
    code = "import sys, aibro_backend.worker.settings; sys.exit('pydantic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, "the worker imports no pydantic"


def test_a_ray_nodes_actor_needs_no_pydantic_settings() -> None:
    """A bare Ray node has Ray's pydantic but not pydantic-settings: the modules its actor imports read the backend's
    settings only where the backend itself calls them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'pydantic_settings': raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import aibro_backend.providers.ray_actor, aibro_backend.providers.local, aibro_backend.providers.sandbox\n"
        "aibro_backend.providers.sandbox.Sandbox.choose(sys.executable, 'none')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_network_bridge_runs_alone_on_a_machine_with_no_aibro(tmp_path: Path) -> None:
    """A played EC2 machine (tests/firstboot.py) carries its routes with a copy of worker/netbridge.py and the system
    Python alone: the module reads its one variable itself and imports nothing of aibro's."""
    from aibro_backend.worker import netbridge

    (tmp_path / "netbridge.py").write_text(Path(netbridge.__file__).read_text())
    code = "import sys; sys.path.insert(0, sys.argv[1]); import netbridge; print(netbridge.folder())"
    env = {"AIBRO_WORKER_NET_BRIDGE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path), done.stderr


def test_every_aibro_variable_the_code_names_is_a_documented_setting() -> None:
    """A new AIBRO_* variable read anywhere must be a field of its process's settings class (and so in the README)."""
    known = {
        v for dotted in settingsdoc.CLASSES for _, v, *_ in settingsdoc.documented(settingsdoc.settings_class(dotted))
    }
    heredocs = {"AIBRO_CA", "AIBRO_ENV", "AIBRO_GET", "AIBRO_UNIT"}  # the EC2 user data's shell here-document markers
    root = README.parent
    named: dict[str, str] = {}
    for package in ("aibro_jupyter", "backend/aibro_backend", "backend/aibro_core"):
        for path in sorted((root / package).rglob("*.py")):
            for name in re.findall(r"AIBRO_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
                named.setdefault(name, str(path.relative_to(root)))
    unknown = {name: where for name, where in named.items() if name not in known | heredocs}
    assert not unknown, f"AIBRO_* variables that no settings class declares: {unknown}"
