"""Bad input is a 4xx naming the problem, never a 500 (issue 10 items 2, 5, 9): NaN/Infinity anywhere in JSON,
JSON nested 100,000 deep, query values that do not fit, every fit argument at submit, worker events checked like
user input, and a job list that survives rows stored before any of this was checked."""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.progress import JobView

from conftest import make_model
from helpers import backend_db, instance_pid, slow_data, wait_for, worker_process

pytestmark = pytest.mark.fast

SHA = hashlib.sha256(b"bytes no test uploads").hexdigest()  # a spec that passes validation stops at "not uploaded"
BASE = {"model": SHA, "data": {"x": {"blob": SHA}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}


def _tree(levels: int) -> dict[str, Any]:
    """A data tree `levels` deep: dicts and lists in turn around one array."""
    node: dict[str, Any] = {"blob": SHA}
    for i in range(levels - 1):
        node = {"dict": {"k": node}} if i % 2 else {"list": [node]}
    return node


def _raw(client: BackendClient, method: str, path: str, body: str | bytes | None = None, token: str = "") -> Any:
    headers = {"Authorization": f"Bearer {token or client.t.token}", "Content-Type": "application/json"}
    return requests.request(method, f"{client.url}/api/v1{path}", data=body, headers=headers, timeout=60)


def _refused(resp: requests.Response, status: int, pattern: str) -> dict[str, Any]:
    import re

    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert re.search(pattern, body["error"]), body
    return body


def _jobs_answer(client: BackendClient) -> None:
    """GET /jobs answers 200 with standard JSON (no NaN: the sidebar's JSON.parse would fail on it)."""
    resp = _raw(client, "GET", "/jobs")
    assert resp.status_code == 200, resp.text[:500]
    json.loads(resp.text, parse_constant=lambda c: pytest.fail(f"{c} in GET /jobs"))


# -- JSON itself ----------------------------------------------------------------------------------------------
HEAD = f'"model": "{SHA}", "data": {{"x": {{"blob": "{SHA}"}}}}, "machines": ["local-cpu"]'


@pytest.mark.parametrize(
    "body",
    [
        "{" + HEAD + ', "cool_down_s": NaN}',
        "{" + HEAD + ', "wait_request_s": Infinity}',
        "{" + HEAD + ', "fit": {"class_weight": {"0": -Infinity}}}',
        '{"meta": {"a": "b"}, "x": [1, 2, NaN]}',
    ],
)
def test_nan_and_infinity_are_refused_anywhere_in_json(client: BackendClient, body: str) -> None:
    before = len(client.jobs())
    _refused(_raw(client, "POST", "/jobs", body), 400, r"is not a JSON number: send finite numbers only")
    assert len(client.jobs()) == before
    _jobs_answer(client)


def test_json_nested_100000_deep_is_a_400(client: BackendClient) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    _refused(_raw(client, "POST", "/jobs", deep), 400, r"nested deeper than 32 levels")
    deep_obj = '{"a":' * 100_000 + "1" + "}" * 100_000
    _refused(_raw(client, "POST", "/jobs", deep_obj), 400, r"nested deeper than 32 levels")
    medium = {"model": SHA, "data": {"x": {"blob": SHA}}, "machines": ["local-cpu"]}
    node: dict[str, Any] = {"blob": SHA}
    for _ in range(40):  # deep enough for the cap, shallow enough for Python's own parser
        node = {"list": [node]}
    medium["data"] = {"x": node}
    _refused(_raw(client, "POST", "/jobs", json.dumps(medium)), 400, r"nested deeper than 32 levels")


def test_a_body_that_is_not_an_object_or_not_utf8(client: BackendClient) -> None:
    _refused(_raw(client, "POST", "/jobs", "[1, 2]"), 400, r"must be a JSON object")
    _refused(_raw(client, "POST", "/jobs", b"\xff\xfe{"), 400, r"not JSON")
    _refused(_raw(client, "POST", "/jobs", "{"), 400, r"not JSON")


# -- query parameters ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query", "pattern"),
    [
        ("after=99999999999999999999", r"'after' must be an integer from 0 to 9223372036854775807.*'9999"),
        ("after=9223372036854775808", r"'after' must be an integer from 0 to 9223372036854775807"),
        ("after=-1", r"'after' must be an integer"),
        ("after=1.5", r"'after' must be an integer"),
        ("after=abc", r"'after' must be an integer"),
        ("wait=nan", r"'wait' must be a finite number of seconds.*'nan'"),
        ("wait=inf", r"'wait' must be a finite number of seconds"),
        ("wait=1e400", r"'wait' must be a finite number of seconds"),
        ("wait=abc", r"'wait' must be a finite number of seconds.*'abc'"),
        ("wait=-1", r"'wait' must be a finite number of seconds"),
    ],
)
def test_event_query_values_that_do_not_fit_are_a_400(client: BackendClient, query: str, pattern: str) -> None:
    _refused(_raw(client, "GET", f"/events?{query}"), 400, pattern)


def test_event_query_limits_that_fit(client: BackendClient) -> None:
    resp = _raw(client, "GET", "/events?after=9223372036854775807&wait=0")
    assert resp.status_code == 200 and resp.json() == {"events": [], "cursor": 9223372036854775807}
    t0 = time.monotonic()
    assert _raw(client, "GET", "/events?after=9223372036854775807&wait=0.2").status_code == 200
    assert time.monotonic() - t0 < 10


# -- the job spec at submit ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ({"cool_down_s": "60"}, r"'cool_down_s' must be a number of seconds between 0 and one week"),
        ({"cool_down_s": -1}, r"'cool_down_s' must be a number of seconds between 0 and one week"),
        ({"cool_down_s": 10**9}, r"'cool_down_s' must be a number of seconds between 0 and one week"),
        ({"wait_request_s": "abc"}, r"'wait_request_s' must be a number of seconds.*got 'abc'"),
        ({"wait_request_s": -5}, r"'wait_request_s' must be a number of seconds"),
        ({"fit": {"batch_size": -1}}, r"fit.batch_size must be a positive integer of at most 16777216 .*, got -1"),
        ({"fit": {"batch_size": 0}}, r"fit.batch_size must be a positive integer"),
        ({"fit": {"batch_size": 32.5}}, r"fit.batch_size must be a positive integer"),
        ({"fit": {"batch_size": True}}, r"fit.batch_size must be a positive integer"),
        ({"fit": {"epochs": 0}}, r"epochs must be a positive integer, got 0"),
        ({"fit": {"epochs": "3"}}, r"epochs must be a positive integer, got '3'"),
        ({"fit": {"epochs": 10**7}}, r"epochs must be a positive integer"),
        ({"fit": {"shuffle": "yes"}}, r"fit.shuffle must be true or false"),
        ({"fit": {"shuffle": 1}}, r"fit.shuffle must be true or false"),
        ({"fit": {"class_weight": {"a": 1.0}}}, r"fit.class_weight must map class indices"),
        ({"fit": {"class_weight": {"0": -1}}}, r"fit.class_weight must map class indices .* non-negative"),
        ({"fit": {"class_weight": [1, 2]}}, r"fit.class_weight must map class indices"),
        ({"fit": {"validation_split": 1}}, r"fit.validation_split must be a number in \[0, 1\)"),
        ({"fit": {"validation_split": -0.1}}, r"fit.validation_split must be a number in \[0, 1\)"),
        ({"fit": {"steps_per_epoch": 0}}, r"fit.steps_per_epoch must be a positive integer"),
        ({"fit": {"validation_steps": 1.5}}, r"fit.validation_steps must be a positive integer"),
        ({"fit": {"validation_batch_size": -2}}, r"fit.validation_batch_size must be a positive integer"),
        ({"fit": {"validation_freq": 0}}, r"fit.validation_freq must be a positive integer"),
        ({"fit": {"epochs": 3, "initial_epoch": 3}}, r"fit.initial_epoch \(3\) must be less than epochs \(3\)"),
        ({"fit": {"initial_epoch": -1}}, r"fit.initial_epoch must be a non-negative integer"),
        ({"fit": {"verbose": 2}}, r"fit arguments \['verbose'\] cannot travel"),
        ({"fit": []}, r"'fit' must be an object of model.fit keyword arguments"),
        ({"safe_mode": "false"}, r"'safe_mode' must be true or false"),
        ({"record": 0}, r"'record' must be true or false"),
        ({"machines": "local-cpu"}, r"'machines' must be a non-empty list of machine ids"),
        ({"machines": ["local-cpu"] * 17}, r"at most 16 machines"),
        ({"model": SHA + "0"}, r"'model' must be the sha256 of an uploaded .keras file"),
        ({"model": SHA.upper()}, r"'model' must be the sha256"),
        ({"data": {"x": {"blob": SHA}, "y": {"dataset": SHA}}}, r"data.y cannot be a dataset"),
        ({"data": {"x": {"list": [{"blob": SHA}, {"blob": "x"}]}}}, r"data.x.list\[1\].blob must be a sha256"),
        ({"data": {"x": {"blob": SHA, "list": []}}}, r"data.x must hold exactly one of 'blob', 'list' or 'dict'"),
        ({"data": {"x": {"dataset": SHA}, "y": {"blob": SHA}}}, r"data holds a dataset.*y and sample_weight"),
        ({"data": {"x": {"blob": SHA}, "y": _tree(9)}}, r"data.y nests lists and dicts more than 8 levels deep: pass"),
        ({"data": {"x": _tree(8)}}, rf"blob {SHA} was not uploaded by this user"),
        ({"data": {"x": {"blob": SHA, "shape": [-1]}}}, r"data.x.shape must be a list of at most 32 non-negative"),
        ({"callbacks": [{"class": "EarlyStopping", "config": {"patience": "3"}}]}, r"EarlyStopping config: 'patience'"),
        ({"callbacks": [{"class": "ReduceLROnPlateau", "config": {"factor": 2.0}}]}, r"ReduceLROnPlateau config"),
        ({"callbacks": [{"class": "RemoteMonitor"}]}, r"Keras callbacks that can travel"),
        ({"requirements": "numpy"}, r"'requirements' must be a list of requirement strings"),
        ({"requirements": ["--index-url=http://x"]}, r"'requirements'"),
        ({"code": {"blob": SHA, "files": [{"path": "../up.py", "bytes": 1, "sha256": SHA}]}}, r"'code.files'"),
        ({"meta": {"k": 1}}, r"'meta' must be an object of at most 8 short strings"),
        ({"versions": {"k" * 40: "1"}}, r"'versions' must be an object"),
        ({"descripton": "typo"}, r"the job spec has unknown fields \['descripton'\]; allowed: .*'description'"),
    ],
)
def test_every_job_spec_field_is_checked_at_submit(
    client: BackendClient, override: dict[str, Any], pattern: str
) -> None:
    spec = {**BASE, **override}
    _refused(_raw(client, "POST", "/jobs", json.dumps(spec)), 400, pattern)


def test_a_spec_that_passes_every_check_stops_at_the_missing_blob(client: BackendClient) -> None:
    spec = {
        **BASE,
        "fit": {
            "epochs": 3,
            "batch_size": 8,
            "shuffle": False,
            "class_weight": {"0": 1.0, "1": 2.5},
            "initial_epoch": 1,
            "steps_per_epoch": None,
            "validation_split": 0.25,
            "validation_freq": 2,
        },
        "callbacks": [{"class": "EarlyStopping", "config": {"patience": 2, "baseline": None}}],
        "cool_down_s": 0,
        "wait_request_s": None,
        "meta": {"variable": "model"},
    }
    _refused(_raw(client, "POST", "/jobs", json.dumps(spec)), 400, rf"blob {SHA} was not uploaded by this user")


def test_replay_overrides_are_checked(client: BackendClient, finished_job: str) -> None:
    path = f"/jobs/{finished_job}/replay"
    _refused(_raw(client, "POST", path, json.dumps({"machines": "x"})), 400, r"'machines' must be a non-empty list")
    _refused(_raw(client, "POST", path, json.dumps({"description": 5})), 400, r"'description' must be a string")
    _refused(_raw(client, "POST", path, json.dumps({"epochs": 5})), 400, r"unknown fields \['epochs'\]")


# -- a real job, its worker's token, and rows stored before events were checked -------------------------------
@pytest.fixture(scope="module")
def finished_job(client: BackendClient, digits: tuple) -> str:
    x, y = digits[0][:64], digits[1][:64]
    job_id = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2)).job_id
    wait_for(client, job_id, lambda evs: any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs))
    assert client.job(job_id).status == v.COMPLETED
    return job_id


def _worker_token(home: Path, instance_id: str) -> str:
    """The token the backend gave this instance's worker, from the worker process's own environment."""
    pid = worker_process(instance_pid(home, instance_id))
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"AIBRO_WORKER_TOKEN="))


@pytest.fixture(scope="module")
def training_job(client: BackendClient, aibro_home: Path) -> Any:
    """A job that trains for a while: (job_id, attempt, worker token)."""
    x, y = slow_data(2000)
    job_id = (
        Training(client)
        .submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=60, batch_size=16))
        .job_id
    )
    wait_for(client, job_id, lambda evs: any(e["type"] == "epoch" for e in evs))
    job = client.job(job_id)
    yield job_id, job.attempt, _worker_token(aibro_home, job.instance_id)
    client.cancel(job_id)


BAD_EVENTS = [
    ({"type": "status", "data": {"status": "PWNED", "substatus": "TRAINING"}}, r"may not set status 'PWNED'"),
    ({"type": "status", "data": {"status": "COMPLETED", "substatus": "COMPLETED"}}, r"may not set"),
    ({"type": "status", "data": {"status": "TRAINING", "substatus": "REQUESTING SERVER"}}, r"may not set substatus"),
    ({"type": "epoch", "data": {"epoch": 0, "epochs": 60, "seconds": 1.0}}, r"epoch event's 'logs' is required"),
    ({"type": "epoch", "data": {"epoch": "1", "epochs": 60, "logs": {}, "seconds": 1}}, r"epoch event's 'epoch'"),
    ({"type": "epoch", "data": {"epoch": -1, "epochs": 60, "logs": {}, "seconds": 1}}, r"epoch event's 'epoch'"),
    ({"type": "epoch", "data": {"epoch": 0, "epochs": 60, "logs": {"loss": "x"}, "seconds": 1}}, r"logs.loss"),
    ({"type": "epoch", "data": {"epoch": 0, "epochs": 60, "logs": [], "seconds": 1}}, r"'logs'"),
    ({"type": "epoch", "data": {"epoch": 500, "epochs": 60, "logs": {}, "seconds": 1}}, r"past the job's 60 epochs"),
    ({"type": "batch", "data": {"epoch": 0, "batch": "x"}}, r"batch event's 'batch'"),
    ({"type": "log", "data": {"message": "x" * 9000}}, r"log event's 'message'"),
    ({"type": "log", "data": {}}, r"log event's 'message' is required"),
    ({"type": "error", "data": {"message": 5}}, r"error event's 'message'"),
    ({"type": "artifact", "data": {"name": "model.keras"}}, r"event type 'artifact' is not accepted from a worker"),
    ({"type": "log", "data": "hello"}, r"events\[0\].data must be an object, got 'hello'"),
]


@pytest.mark.parametrize(("event", "pattern"), BAD_EVENTS)
def test_worker_events_are_checked_like_user_input(
    client: BackendClient, training_job: Any, event: dict[str, Any], pattern: str
) -> None:
    job_id, attempt, token = training_job
    wseq = 10**9 + secrets.randbelow(10**6)
    body = {"attempt": attempt, "events": [{**event, "wseq": wseq, "ts": time.time()}]}
    refused = _refused(_raw(client, "POST", f"/worker/jobs/{job_id}/events", json.dumps(body), token), 400, pattern)
    assert refused.get("wseq") == wseq, "the refusal names the bad event, so the worker's outbox can drop it"
    job = client.job(job_id)
    assert job.status == v.TRAINING, job.status
    _jobs_answer(client)


def test_a_worker_batch_shape_is_checked(client: BackendClient, training_job: Any) -> None:
    job_id, attempt, token = training_job
    path = f"/worker/jobs/{job_id}/events"
    for body, pattern in [
        ({"attempt": "x", "events": []}, r"'attempt'"),
        ({"attempt": attempt, "events": {}}, r"'events'"),
        ({"attempt": attempt, "events": [{"type": "log", "data": {"message": "m"}}] * 501}, r"'events'"),
        (
            {"attempt": attempt, "events": [{"type": "log", "wseq": "1", "data": {"message": "m"}}]},
            r"'events\[0\].wseq'",
        ),
        ({"attempt": attempt, "events": [{"type": "log", "wseq": 10**9, "ts": 1e300, "data": {"message": "m"}}]}, "ts"),
    ]:
        _refused(_raw(client, "POST", path, json.dumps(body), token), 400, pattern)
    good = {"attempt": attempt, "events": [{"type": "log", "wseq": 2 * 10**9, "data": {"message": "checked"}}]}
    resp = _raw(client, "POST", path, json.dumps(good), token)
    assert resp.status_code == 200 and resp.json()["acked"] >= 2 * 10**9
    finish = f"/worker/jobs/{job_id}/finish"
    _refused(_raw(client, "POST", finish, json.dumps({"attempt": "0", "outcome": "completed"}), token), 400, "attempt")
    _refused(_raw(client, "POST", finish, json.dumps({"attempt": attempt, "outcome": "won"}), token), 400, "outcome")
    assert client.job(job_id).status == v.TRAINING


def test_old_bad_rows_never_break_the_job_list(client: BackendClient, aibro_home: Path, finished_job: str) -> None:
    """Rows a worker could store before events were checked: GET /jobs, the job and its events still answer,
    in standard JSON, and the picture skips what it cannot use."""
    job_id = finished_job
    (uid,) = backend_db(aibro_home, "SELECT user_id FROM jobs WHERE id=?", job_id)[0]
    (seq,) = backend_db(aibro_home, "SELECT MAX(seq) FROM events WHERE job_id=?", job_id)[0]
    bad = [
        ("status", {"status": "PWNED", "substatus": "TRAINING"}),
        ("epoch", {"epoch": 0}),
        ("epoch", {"epoch": "x", "logs": {}}),
        ("batch", {"epoch": 0}),
        ("epoch", {"epoch": 1, "logs": {"loss": float("nan")}, "seconds": float("inf")}),
        ("error", "not an object"),
    ]
    rows = [(job_id, uid, seq + i, t, time.time(), json.dumps(d)) for i, (t, d) in enumerate(bad, start=1)]
    _write_db(aibro_home, "INSERT INTO events (job_id, user_id, seq, type, ts, data) VALUES (?,?,?,?,?,?)", rows)
    _write_db(aibro_home, "UPDATE jobs SET status='PWNED' WHERE id=?", [(job_id,)])
    try:
        _jobs_answer(client)
        job = client.job(job_id)
        assert job.status == v.COMPLETED, "a status outside the vocabulary is shown as the last valid one"
        assert [h.epoch for h in job.history] == [1, 2] and job.history[1].loss is None
        events = _raw(client, "GET", f"/jobs/{job_id}/events").text
        json.loads(events, parse_constant=lambda c: pytest.fail(f"{c} in the events"))
        view = JobView(job_id)
        for ev in json.loads(events)["events"]:
            view.apply(ev)
        assert view.status == v.COMPLETED and sorted(view.history) == [0, 1]
    finally:
        _write_db(aibro_home, "UPDATE jobs SET status='COMPLETED' WHERE id=?", [(job_id,)])


def _write_db(home: Path, sql: str, rows: list[tuple]) -> None:
    """Write into the backend's database as an old backend would have (the API refuses these rows now)."""
    db = sqlite3.connect(str(home / "state" / "aibro.db"), timeout=30)
    try:
        with db:
            db.executemany(sql, rows)
    finally:
        db.close()


# -- the worker's side of a refusal --------------------------------------------------------------------------
class _Backend:
    """Stands in for the backend's worker route: refuses any batch holding wseq 2 with a 400 naming it."""

    def __init__(self) -> None:
        self.stored: list[int] = []

    def json(self, method: str, path: str, json: dict[str, Any], timeout: float) -> dict[str, Any]:
        from aibro_core.errors import ApiError

        wseqs = [e["wseq"] for e in json["events"]]
        if 2 in wseqs:
            raise ApiError(400, "a log event's 'message' ...", {"error": "...", "status": 400, "wseq": 2})
        self.stored += [w for w in wseqs if w not in self.stored]
        return {"acked": max(self.stored), "cancel": False}


def test_the_worker_outbox_drops_a_refused_event_and_sends_the_rest() -> None:
    """A 400 can never succeed on a resend: the outbox drops the event it names (not the batch) and goes on, and
    flush() returns instead of waiting for an acknowledgement that will never come."""
    from aibro_backend.worker.outbox import Outbox

    backend = _Backend()
    outbox = Outbox(backend, "job-x", 0)  # type: ignore[arg-type]
    try:
        for i in range(4):
            outbox.put("log", {"message": f"m{i}"})
        assert outbox.flush(timeout=10), "flush returns once every event is stored or dropped"
        assert backend.stored == [1, 3, 4] and not outbox.pending
    finally:
        outbox.close()


def test_the_depth_cap_counts_levels_not_brackets_in_strings() -> None:
    """Exactly 32 levels of objects and arrays pass and 33 are refused, however they alternate; strings full of
    brackets and escaped quotes never count."""
    from aibro_backend.api.base import parse_json

    def nested(levels: int) -> str:
        node: Any = {"s": '[{"\\]]}}"[[[ü[😀{' * 20}  # one level: an object whose string is all brackets
        for n in range(levels - 1):
            node = [node, "[" * 40] if n % 2 else {"k[": node, "q": '"{{{'}
        return json.dumps(node, ensure_ascii=levels % 2 == 0)

    for levels in (1, 31, 32):
        assert parse_json(nested(levels)) is not None
    for levels in (33, 34):
        with pytest.raises(ValueError, match="nested deeper than 32 levels"):
            parse_json(nested(levels))
