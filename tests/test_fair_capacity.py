"""Capacity is shared fairly on the local provider: a machine one user keeps warm (cooling) never blocks another
user's queued job, and a queued job says what it waits for."""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_proc import own_backend

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import slow_data, wait_for


def _final(events: list[dict]) -> bool:
    return any(e["type"] == "status" and e["data"].get("status") in v.JOB_FINAL for e in events)


def test_a_cooling_instance_of_one_user_makes_room_for_another_users_job(tmp_path: Path) -> None:
    home = tmp_path / "shared"
    with own_backend(home, AIBRO_LOCAL_CAPACITY="1") as backend:
        alice = backend.client()
        bob = backend.add_user("bob")
        x, y = slow_data(3000)
        # alice trains until canceled below, so bob's job queues behind her whatever the load
        first = Training(alice).submit(
            FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1000, batch_size=16, cool_down_period_s=600)
        )
        wait_for(alice, first.job_id, lambda evs: any(e["type"] == "epoch" for e in evs))
        second = Training(bob).submit(FitRequest(make_model(1), x[:500], y[:500], machine_ids="local-cpu", epochs=1))
        queued = wait_for(
            bob,
            second.job_id,
            lambda evs: any("waiting for local-cpu" in e["data"].get("message", "") for e in evs),
            timeout=120,
        )
        message = next(e["data"]["message"] for e in queued if "waiting for" in e["data"].get("message", ""))
        assert message == "waiting for local-cpu: all 1 in use (1 training)", message
        assert bob.job(second.job_id).substatus == v.REQUESTING_SERVER
        alice.cancel(first.job_id)  # its machine cools for alice, as after any job of hers
        wait_for(alice, first.job_id, _final, timeout=300)
        events = wait_for(bob, second.job_id, _final, timeout=300)
        assert bob.job(second.job_id).status == v.COMPLETED
        evicted = [e["data"]["message"] for e in events if "to make room" in e["data"].get("message", "")]
        assert evicted == ["closed a cooling local-cpu instance (another user's) to make room for this job"]
        alice_instances = {i.id: i for i in alice.instances()}
        first_instance = alice.job(first.job_id).instance_id
        assert alice_instances[first_instance].status in (v.CLOSING, v.CLOSED), "alice's warm machine was closed"
        assert bob.job(second.job_id).instance_id != first_instance, "a warm worker serves its one user only"
        messages = [e["data"].get("message") for e in events if e["type"] == "status"]
        assert messages.count(message) == 1, "the waiting message is said once, not every tick"


@pytest.mark.backend_log(r"aibro\.scheduler ERROR cannot schedule job-bad-row")
def test_one_bad_job_row_never_blocks_everyone_elses(tmp_path: Path) -> None:
    """A job stored with a NaN cool-down (as an older backend accepted) once made every scheduler tick fail, so
    every user's queued job waited forever. Now that job fails with a message, and the others run."""
    import json
    import sqlite3
    import time

    home = tmp_path / "one-bad-row"
    with own_backend(home) as backend:
        client = backend.client()
        x, y = slow_data(200)
        good = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1))
        wait_for(client, good.job_id, _final, timeout=300)
        spec = json.loads(
            sqlite3.connect(str(home / "state" / "aibro.db")).execute("SELECT spec FROM jobs").fetchone()[0]
        )
        db = sqlite3.connect(str(home / "state" / "aibro.db"))
        now = time.time()
        db.execute(
            "INSERT INTO jobs (id, user_id, status, substatus, spec, description, created, updated) "
            "SELECT 'job-bad-row', user_id, 'QUEUING', 'REQUESTING SERVER', ?, 'bad row', ?, ? FROM jobs LIMIT 1",
            (json.dumps({**spec, "cool_down_s": float("nan")}), now, now),
        )
        db.commit()
        db.close()
        after = Training(client).submit(FitRequest(make_model(2), x, y, machine_ids="local-cpu", epochs=1))
        wait_for(client, after.job_id, _final, timeout=300)
        assert client.job(after.job_id).status == v.COMPLETED
        deadline = time.monotonic() + 30
        while client.job("job-bad-row").status != v.CANCELED and time.monotonic() < deadline:
            time.sleep(0.2)
        bad = client.job("job-bad-row")
        assert bad.status == v.CANCELED and "could not schedule this job" in (bad.error or ""), bad
