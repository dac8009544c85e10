"""One reduction of events into a job picture per language (issue 25 item 3): the Python reducer
(aibro_core/jobpicture.py), the store's summary row of a job (status, substatus, epochs_done, written with each
batch of events) and the sidebar's TypeScript reducer (labextension/src/jobpicture.ts, run under node) turn the
same event logs (tests/fixtures/event_logs.json) into the same pictures."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from records import job_spec

from aibro_backend.api.user import job_view
from aibro_backend.storage.events import NewEvent
from aibro_backend.storage.store import Store
from aibro_core.jobpicture import JobPicture

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT / "tests" / "fixtures" / "event_logs.json").read_text())
FIELDS = ("status", "substatus", "epochs_done", "epochs", "error", "timeline", "history")


def _picture(status: str, substatus: str, done: int, epochs: Any, error: Any, timeline: Any, history: Any) -> dict:
    return {
        "status": status,
        "substatus": substatus,
        "epochs_done": done,
        "epochs": epochs,
        "error": error,
        "timeline": [[t["status"], t["substatus"]] for t in timeline],
        "history": [[row["epoch"], row.get("loss")] for row in history],
    }


def python_picture(events: list[dict[str, Any]]) -> dict[str, Any]:
    p = JobPicture().apply_all(events)
    return _picture(p.status, p.substatus, p.epochs_done, p.epochs, p.error, p.timeline, p.history_rows())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_python_reducer(case: dict[str, Any]) -> None:
    assert python_picture(case["events"]) == case["picture"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.parametrize("batches", ["one-by-one", "one-batch"])
def test_the_stores_summary_and_the_job_view(case: dict[str, Any], batches: str, tmp_path: Path) -> None:
    store = Store(tmp_path / "aibro.db")
    try:
        uid = store.users.ensure("u")
        store.jobs.create("job-1", uid, job_spec(fit={"epochs": 9}))
        events = [NewEvent(ev["type"], ev["data"], None, ev["ts"]) for ev in case["events"]]
        for chunk in [[ev] for ev in events] if batches == "one-by-one" else [events]:
            store.events.append_many("job-1", chunk)
        row = store.jobs.get("job-1")
        want = case["picture"]
        assert (row.status, row.substatus, row.epochs_done) == (
            want["status"],
            want["substatus"],
            want["epochs_done"],
        )
        view = job_view(row, store, {}).model_dump(mode="json")
        seen = _picture(
            view["status"], view["substatus"], view["epochs_done"], want["epochs"], view["error"],
            view["timeline"], view["history"],
        )  # fmt: skip
        assert seen == want
    finally:
        store.close()


DRIVER = """
const { applyEvent } = require('./jobpicture.js');
const cases = JSON.parse(require('fs').readFileSync(process.argv[2], 'utf8'));
const out = cases.map(c => {
  const job = { status: 'QUEUING', substatus: 'REQUESTING SERVER', timeline: [], history: [], epochs_done: 0,
                epochs: null, error: null, machine_id: null };
  c.events.forEach(ev => applyEvent(job, ev));
  return { status: job.status, substatus: job.substatus, epochs_done: job.epochs_done, epochs: job.epochs,
           error: job.error, timeline: job.timeline.map(t => [t.status, t.substatus]),
           history: job.history.map(h => [h.epoch, h.loss === undefined ? null : h.loss]) };
});
console.log(JSON.stringify(out));
"""


def test_the_typescript_reducer_under_node(tmp_path: Path) -> None:
    tsc = ROOT / "node_modules" / ".bin" / "tsc"
    if not tsc.exists() or shutil.which("node") is None:
        pytest.fail("node and node_modules are needed: the README's commands install them (pip install -e .)")
    if not (ROOT / "labextension" / "src" / "generated" / "openapi.ts").exists():
        pytest.fail("labextension/src/generated/openapi.ts is missing: `jlpm build:types` (pip install -e . runs it)")
    config = {
        "extends": str(ROOT / "tsconfig.json"),
        "compilerOptions": {
            "module": "commonjs",
            "outDir": str(tmp_path / "out"),
            "rootDir": str(ROOT / "labextension" / "src"),
            "composite": False,
            "incremental": False,
            "declaration": False,
        },
        "files": [str(ROOT / "labextension" / "src" / "jobpicture.ts")],
    }
    (tmp_path / "tsconfig.json").write_text(json.dumps(config))
    done = subprocess.run([str(tsc), "-p", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "out" / "driver.js").write_text(DRIVER)
    fixture = ROOT / "tests" / "fixtures" / "event_logs.json"
    run = subprocess.run(
        ["node", "driver.js", str(fixture)], cwd=tmp_path / "out", capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for case, seen in zip(CASES, json.loads(run.stdout), strict=True):
        assert seen == case["picture"], case["name"]


def test_the_job_view_names_the_files_a_callback_writes_and_a_row_it_cannot_read(tmp_path: Path) -> None:
    """A job with a checked callback (EarlyStopping's config is a model, naming no file) beside one writing a file
    shows that file and the working directory; a row this version's JobSpec refuses still shows, with no machines."""
    store = Store(tmp_path / "aibro.db")
    try:
        uid = store.users.ensure("u")
        callbacks = [
            {"class": "EarlyStopping", "config": {"patience": 2}},
            {"class": "CSVLogger", "config": {"filename": {"__path__": "file", "kernel": "/home/u/log.csv"}}},
        ]
        store.jobs.create("job-1", uid, job_spec(callbacks=callbacks, cwd="/home/u"))
        files = job_view(store.jobs.get("job-1"), store, {}).files
        assert [(f.slot, f.kind, f.kernel) for f in files] == [
            ("1/filename", "file", "/home/u/log.csv"),
            ("job/cwd", "dir", "/home/u"),
        ]
        store.db.execute("UPDATE jobs SET spec=? WHERE id='job-1'", ('{"machines": "nowhere"}',))
        row = store.jobs.get("job-1")
        assert row.spec is None
        view = job_view(row, store, {})
        assert (view.machines, view.files, view.epochs) == ([], [], 1)
    finally:
        store.close()
