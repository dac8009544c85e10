"""A study's life as events (issue 40 item 2): the backend appends `study` events (a trial started, a trial ended
with its score, the study ended) to the study's own log, kept, long-polled and followed as a job's events are,
and its driver steps on events instead of a clock. Issue 40 item 1's handover: with no cool-down, each trial
after the first starts on the worker the previous trial just left, warm."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import keras_tuner as kt
import pytest
import requests
from backend_proc import own_backend
from records import job_spec
from searchmodels import build_model

from aibro_backend.storage.events import NoSuchJob
from aibro_backend.storage.store import Store
from aibro_core import vocabulary as v
from aibro_core.models import StudyEventData, StudyEvents
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.search import follow, given_args, start_study

from helpers import slow_data, wait_until


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with own_backend(tmp_path_factory.mktemp("studyevents") / "home") as b:
        yield b


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def study_log(client: Any, study_id: str, after: int = 0) -> tuple[list[dict[str, Any]], str]:
    """The study's events after `after` until its log ends (a final page with nothing new), long-polled as a
    follower reads them, and the last page's status."""
    events: list[dict[str, Any]] = []
    while True:
        page = StudyEvents.model_validate(client.study_events(study_id, after, wait=25))
        events += [e.model_dump() for e in page.events]
        after = events[-1]["seq"] if events else after
        if not page.events and page.status in v.STUDY_FINAL:
            return events, page.status


@pytest.mark.fast
def test_a_studys_events_are_a_log_of_its_own_in_its_users_stream(store: Store) -> None:
    uid = store.users.ensure("u")
    store.jobs.create("job-a", uid, job_spec())
    store.studies.create("study-x", uid, {}, "")
    started = {"event": v.StudyEvent.TRIAL_STARTED, "trial_id": "0", "job_id": "job-a"}
    store.events.append("study-x", v.EV_STUDY, started)
    store.events.append("job-a", v.EV_LOG, {"message": "a job's own event"})
    store.events.append("study-x", v.EV_STUDY, {"event": v.StudyEvent.STUDY_ENDED, "status": v.STUDY_COMPLETED})
    mine = [json.loads(p) for p in store.events.parts("study-x")]
    assert [(e["seq"], e["type"], e["data"]["event"]) for e in mine] == [
        (1, v.EV_STUDY, v.StudyEvent.TRIAL_STARTED),
        (2, v.EV_STUDY, v.StudyEvent.STUDY_ENDED),
    ], "gap-free seqs of its own, as a job's log has"
    assert [json.loads(p)["seq"] for p in store.events.parts("job-a")] == [1], "the job's log is untouched"
    stream, _cursor = store.events.user_parts(uid)
    assert [json.loads(p)["job_id"] for p in stream] == ["study-x", "job-a", "study-x"], "in the user's stream"
    with pytest.raises(ValueError, match="takes study events only"):
        store.events.append("study-x", v.EV_LOG, {"message": "not a study's"})
    with pytest.raises(ValueError, match="goes to its study's log"):
        store.events.append("job-a", v.EV_STUDY, started)
    with pytest.raises(NoSuchJob):
        store.events.append("study-nobody", v.EV_STUDY, started)


def test_a_studys_log_says_each_trial_and_its_end_and_its_trials_share_one_warm_worker(
    backend: Any, tmp_path: Path
) -> None:
    client = backend.client()
    x, y = slow_data(600, seed=3)
    tuner = kt.RandomSearch(build_model, objective="loss", max_trials=3, seed=5, directory=str(tmp_path))
    request = FitRequest(None, x, y, machine_ids="local-cpu", epochs=1, batch_size=64)  # no cool-down
    study_id = start_study(Training(client), tuner, request, verbose=False, search_args=given_args(request))
    events, status = study_log(client, study_id)
    study = client.study(study_id)
    assert status == study.status == v.STUDY_COMPLETED
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    said = [StudyEventData.model_validate(e["data"]) for e in events]
    assert all(e["type"] == v.EV_STUDY and e["job_id"] == study_id for e in events)
    trials = {t.trial_id: t for t in study.trials}
    expected = []
    for trial_id in sorted(trials):
        expected += [(v.StudyEvent.TRIAL_STARTED, trial_id), (v.StudyEvent.TRIAL_ENDED, trial_id)]
    assert [(e.event, e.trial_id) for e in said] == [*expected, (v.StudyEvent.STUDY_ENDED, None)], said
    for e in said:
        if e.event == v.StudyEvent.TRIAL_STARTED:
            assert e.job_id == trials[e.trial_id].job_id and e.execution == 0 and e.slot == "slot-0"
        elif e.event == v.StudyEvent.TRIAL_ENDED:
            assert (e.status, e.score) == (v.TRIAL_COMPLETED, trials[e.trial_id].score), "with its score"
    assert said[-1].status == v.STUDY_COMPLETED and said[-1].best_trial_id == study.best_trial_id

    stream = client.user_events(0)["events"]
    assert [e["data"] for e in stream if e["type"] == v.EV_STUDY] == [e["data"] for e in events], "in the stream"
    port, path = client.health().events_port, f"/api/v1/studies/{study_id}/events?after=0"
    there = requests.get(f"http://127.0.0.1:{port}{path}", headers=bearer(backend.token), timeout=90)
    here = requests.get(backend.url + path, headers=bearer(backend.token), timeout=90)
    assert there.content == here.content and there.json()["status"] == v.STUDY_COMPLETED, "the event port's too"
    eve = backend.add_user("eve")
    theirs = requests.get(f"http://127.0.0.1:{port}{path}", headers=bearer(eve.t.token), timeout=90)
    assert theirs.status_code == 404 and "no study" in theirs.json()["error"], "another user's study is not theirs"

    # The handover: each next trial was admitted as the previous one's job ended and found its worker warm.
    jobs = [client.job(trials[t].job_id) for t in sorted(trials)]
    assert len({j.instance_id for j in jobs}) == 1, [j.instance_id for j in jobs]
    for job in jobs[1:]:
        placed = [
            e["data"].get("message", "")
            for e in client.events(job.job_id)["events"]
            if e["type"] == v.EV_STATUS and e["data"]["substatus"] == v.CONNECTING_SERVER
        ]
        assert len(placed) == 1 and placed[0].startswith("reusing warm instance"), placed
        ready = [e["data"] for e in client.events(job.job_id)["events"] if "timings" in e["data"]]
        assert len(ready) == 1 and set(ready[0]["timings"]) == {"data", "build", "load"}, "where its start went"

    def closed() -> bool:  # held for the study alone (no cool-down asked): it closes with the study
        held = [i for i in client.instances() if i.id == jobs[0].instance_id]
        return all(i.status in (v.CLOSING, v.CLOSED) for i in held)

    assert wait_until(closed), client.instances()


def test_a_cancelled_studys_log_ends_its_running_trial_then_itself(backend: Any, tmp_path: Path) -> None:
    client = backend.client()
    x, y = slow_data(6000, seed=4)
    tuner = kt.RandomSearch(build_model, objective="loss", max_trials=5, directory=str(tmp_path))
    request = FitRequest(None, x, y, machine_ids="local-cpu", epochs=50, batch_size=16)
    study_id = start_study(Training(client), tuner, request, verbose=False, search_args=given_args(request))
    handed: list[tuple[str, dict[str, Any]]] = []  # what a panel is handed: the study's status, the trials' epochs
    followed: dict[str, Any] = {}
    panel = threading.Thread(
        target=lambda: followed.update(
            study=follow(client, study_id, verbose=False, on_poll=lambda s, h: handed.append((s.status, h)))
        )
    )
    panel.start()  # the panel's follower: the user's event stream, long-polled
    page = client.study_events(study_id, 0, wait=25)
    while not page["events"]:  # the first trial's start
        page = client.study_events(study_id, 0, wait=25)
    first = StudyEventData.model_validate(page["events"][0]["data"])
    assert first.event == v.StudyEvent.TRIAL_STARTED
    assert wait_until(lambda: any(rows for _, h in handed for rows in h.values())), "the panel got an epoch"
    client.cancel_study(study_id)
    panel.join(timeout=300)
    assert not panel.is_alive() and followed["study"].status == v.STUDY_CANCELED, "the study's end woke it"
    assert handed[-1][0] == v.STUDY_CANCELED
    events, status = study_log(client, study_id, page["events"][-1]["seq"])
    said = [StudyEventData.model_validate(e["data"]) for e in events]
    assert status == v.STUDY_CANCELED
    assert [(e.event, e.trial_id, e.status) for e in said] == [
        (v.StudyEvent.TRIAL_ENDED, first.trial_id, v.TRIAL_CANCELED),
        (v.StudyEvent.STUDY_ENDED, None, v.STUDY_CANCELED),
    ], said
    ended = follow(client, study_id, verbose=False)  # the kernel's follower ends on the final page
    assert ended is not None and ended.status == v.STUDY_CANCELED
