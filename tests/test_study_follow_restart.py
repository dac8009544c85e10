"""A study's follower against a backend it did not start (AIBRO_BACKEND_URL, `aibro login`) that is killed and
started again, the fault alone (issue 39 item 3, found by benchmarks/soak.py).

The job follower (`client.follow`) retries with backoff and carries on; the study follower (`search.follow`, what
`%%cloud_tune` and `Training.online_search` wait in) called `client.study` with no retry, so its first poll in the
outage raised BackendUnreachable and the search call ended while the study went on. It now waits with the job
follower's backoff and says so."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import keras_tuner as kt
from backend_proc import own_backend
from searchmodels import build_model

from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.search import follow, given_args, start_study

from helpers import slow_data


def test_a_study_follower_outlives_a_backend_restart(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with own_backend(home) as first:
        client = first.client()  # a configured backend: this client cannot restart it, only wait for it
        x, y = slow_data(600)
        tuner = kt.RandomSearch(build_model, objective="loss", max_trials=1, directory=str(tmp_path / "tuner"))
        req = FitRequest(None, x, y, machine_ids="local-cpu", epochs=1, batch_size=64)
        sid = start_study(Training(client), tuner, req, parallel=1, verbose=False, search_args=given_args(req))
        first.proc.kill()
        first.proc.wait()
        got: dict[str, Any] = {}

        def follower() -> None:
            try:
                got["study"] = follow(client, sid, verbose=False)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                got["error"] = exc

        thread = threading.Thread(target=follower)
        thread.start()  # the backend is down now: the follower's first poll finds it gone
        with own_backend(home) as second:
            assert second.url == first.url, "it comes back on its last port"
            thread.join(timeout=600)
    assert not thread.is_alive(), "the follower ended"
    if "error" in got:
        raise got["error"]
    assert got["study"].status == v.STUDY_COMPLETED, got["study"]
