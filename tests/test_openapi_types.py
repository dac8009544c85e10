"""The sidebar's TypeScript types come from the backend's OpenAPI document: the committed document is the backend's,
the TypeScript compiles against it, and a misread answer (the sidebar once read `{job}` from the cancel answer,
which is the job itself) fails the build."""

from __future__ import annotations

import difflib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "labextension" / "scripts"
TSC = ROOT / "node_modules" / ".bin" / "tsc"


def _dump_script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("dump_openapi", SCRIPTS / "dump_openapi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_document_is_the_backends() -> None:
    committed = (ROOT / "labextension" / "openapi.json").read_text()
    live = _dump_script().render()
    if committed != live:
        diff = difflib.unified_diff(committed.splitlines(), live.splitlines(), "committed", "backend", lineterm="")
        pytest.fail(
            "labextension/openapi.json differs from the backend's document: run `jlpm build:openapi` and commit "
            "it (pip installs build the sidebar's types from the committed one)\n" + "\n".join(list(diff)[:40])
        )


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of labextension/src with types generated from the backend's document as it is now, and a
    tsconfig that checks it as `jlpm build` does."""
    if not TSC.exists():
        pytest.fail("node_modules is missing: run `jlpm install` (pip install -e . does it)")
    tmp = tmp_path_factory.mktemp("ts")
    shutil.copytree(ROOT / "labextension" / "src", tmp / "src", ignore=shutil.ignore_patterns("generated"))
    (tmp / "node_modules").symlink_to(ROOT / "node_modules")
    (tmp / "openapi.json").write_text(_dump_script().render())
    generated = tmp / "src" / "generated" / "openapi.ts"
    subprocess.run(
        ["node", str(SCRIPTS / "openapi_types.mjs"), str(tmp / "openapi.json"), str(generated)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    config = {
        "extends": str(ROOT / "tsconfig.json"),
        "compilerOptions": {"rootDir": "src", "noEmit": True, "composite": False, "incremental": False},
        "include": ["src/**/*"],
    }
    (tmp / "tsconfig.json").write_text(json.dumps(config))
    return tmp


def _tsc(project: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(TSC), "-p", str(project)], capture_output=True, text=True, timeout=300)


def test_the_sidebar_compiles_against_the_backends_document(sources: Path) -> None:
    done = _tsc(sources)
    assert done.returncode == 0, done.stdout + done.stderr


def test_reading_a_field_the_answer_lacks_fails_the_build(sources: Path) -> None:
    model = sources / "src" / "model.ts"
    text = model.read_text()
    fixed = "const answer = await api.cancel(jobId);"
    assert fixed in text
    model.write_text(
        text.replace(fixed, "const { job: answer } = await api.cancel(jobId);")  # the sidebar's old reading
    )
    try:
        done = _tsc(sources)
    finally:
        model.write_text(text)
    assert done.returncode != 0, "tsc accepted a read of `job` from the cancel answer"
    assert "Property 'job' does not exist" in done.stdout, done.stdout
