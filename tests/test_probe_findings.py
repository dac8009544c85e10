"""The probe suite's findings (issue 24 item 6), each replayed from a user's side against a real backend.

1. connections the client stops taking answers on (pipelined requests it never reads), on either port;
2. a worker artifact whose name collides with another (a file where a folder must be, or the other way round);
3. unfinished uploads without end, and stored blobs without a bound;
4. a batch size of 10**12;
5. worker folders others can read (a state/workers an older version left 0755, a worker started under umask 022);
6. a worker event batch over its route's limit, which reset the connection instead of answering 413.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from backend_proc import OwnBackend

from aibro_core.errors import ApiError
from aibro_jupyter.client import BackendClient

MiB = 1024 * 1024


def _call(url: str, method: str, path: str, token: str, **kw: Any) -> requests.Response:
    return requests.request(method, f"{url}/api/v1{path}", headers={"Authorization": f"Bearer {token}"}, **kw)


def _ports(b: OwnBackend) -> dict[str, int]:
    info = json.loads((b.home / "backend.json").read_text())
    return {"main": int(info["port"]), "events": int(info["events_port"])}


# -- 4. batch sizes and steps ------------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("field", ["batch_size", "validation_batch_size", "steps_per_epoch", "validation_steps"])
def test_a_batch_size_or_step_count_of_10_to_the_12_is_a_400_naming_it(client: BackendClient, field: str) -> None:
    spec = {
        "model": "0" * 64,
        "data": {"x": {"blob": "0" * 64}},
        "fit": {"epochs": 1, field: 10**12},
        "machines": ["local-cpu"],
    }
    pattern = rf"fit\.{field} must be a positive integer of at most \d+ .*, got 1000000000000"
    with pytest.raises(ApiError, match=pattern) as e:
        client.submit(spec)
    assert e.value.status == 400
