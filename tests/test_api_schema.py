"""Schemathesis against the live backend's generated OpenAPI document (issue 10 item 2): every user route, a
bounded number of generated cases each (valid and invalid bodies, parameters and headers), all default checks
(no 5xx, status codes, content types, headers and bodies as documented, invalid data refused, valid data
accepted, 405 with Allow), and not a single server error. One test runs the whole generated run and judges it,
so the file (or `-k`, or a parallel runner) never skips half of it.

It runs as a user of its own ("fuzz-…", made as an admin would), so what it mints or uploads never counts against
the session's user. Worker routes need a worker's per-instance token and are left out here; their bodies are
checked in tests/test_api_inputs.py against a real worker's token.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from aibro_jupyter.client import BackendClient

from helpers import aibro_cli

MAX_EXAMPLES = 40  # per operation and generation mode
# A request can match the document and still be refused by a check the document cannot state: a spec naming a
# blob this user never uploaded or a machine this backend does not offer, initial_epoch not below epochs, a job with
# both or neither of a model and a trial, a study's oracle arguments or space that KerasTuner would not take, a size
# over a per-user limit (413, also a fine refusal of invalid data). There the positive-data check (and for 413 the
# negative-data one) gives way; every other check still runs.
SEMANTIC_400 = re.compile(
    r"was not uploaded by this user|unknown machine|was not recorded|must be less than epochs|^'requirements'"
    # a job's model or trial (one of them, a trial with its code), a study's job a trial, an oracle's arguments and
    # space as KerasTuner takes them
    r"|a job needs either 'model'|a 'trial' job needs 'code'|a study's 'job' must have a 'trial'|oracle takes no"
    r"|'oracle\.hyperparameters'"
    # a job's object references: one way to find each, by Python names (JSON Schema states no rule on keys)
    r"|an object reference needs either|is not a Python name"
)


@pytest.fixture(scope="module")
def fuzz_user(client: BackendClient, aibro_home: Path) -> tuple[str, str]:
    name = f"fuzz-{secrets.token_hex(3)}"
    made = aibro_cli(aibro_home, "backend", "add-user", name)
    assert made.returncode == 0, made.stderr[-2000:]
    return client.url, re.search(r"--token=(\S+)", made.stdout).group(1)


def test_generated_cases_against_the_live_backend(fuzz_user: tuple[str, str]) -> None:
    """One test, one run: every user route gets valid and invalid cases from the document (schemathesis'
    public `as_strategy`, driven by Hypothesis here, so no pytest plugin internals and no state shared with
    another test), and no case may answer 5xx or differ from what the document says."""
    url, token = fuzz_user
    auth = {"Authorization": f"Bearer {token}"}
    schema = schemathesis.openapi.from_url(f"{url}/api/v1/openapi.json", headers=auth, timeout=30)
    schema.config.update(base_url=f"{url}/api/v1", headers=auth, request_timeout=70)
    operations = [op.ok() for op in schema.exclude(tag="worker").get_all_operations()]
    seen: Counter[str] = Counter()
    server_errors: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run_generated(operation, mode, seen, server_errors)

    doc = requests.get(f"{url}/api/v1/openapi.json", headers=auth, timeout=30).json()
    user_ops = {f"{m.upper()} {p}" for p, ops in doc["paths"].items() if not p.startswith("/worker/") for m in ops}
    user_ops.discard("GET /openapi.json")  # schemathesis leaves out the operation that serves the document itself
    print(f"\n[schemathesis {schemathesis.__version__}] {sum(seen.values())} cases over {len(seen)} operations")
    assert not server_errors, server_errors[:5]
    assert user_ops <= set(seen), f"operations never called: {sorted(user_ops - set(seen))}"
    raw = {op.label: op.definition.raw for op in operations}
    takes_input = {label for label, r in raw.items() if r.get("parameters") or "requestBody" in r}
    assert min(seen[label] for label in takes_input) >= 5, seen  # one without input has one request to make


def _run_generated(operation: Any, mode: GenerationMode, seen: Counter[str], server_errors: list[str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    def run(case: Any) -> None:
        wait = case.query.get("wait") if isinstance(case.query, dict) else None
        if isinstance(wait, (int, float)) and wait > 0.2:
            case.query["wait"] = 0.2  # a valid long-poll wait, kept short so the run stays bounded
        response = case.call(timeout=70)
        label = operation.label
        seen[label] += 1
        if response.status_code >= 500:
            server_errors.append(f"{label} {case.formatted_path}: {response.status_code} {response.text[:300]}")
        excluded = []
        if response.status_code == 400 and SEMANTIC_400.search(_error(response)):
            excluded = [positive_data_acceptance]
        elif response.status_code == 413:
            excluded = [positive_data_acceptance, negative_data_rejection]
        case.validate_response(response, excluded_checks=excluded)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        # an operation that takes nothing (GET /health): there is no invalid request to make of it
    except schemathesis.errors.InvalidSchema as exc:
        if mode is GenerationMode.POSITIVE:
            raise
        # schemathesis' own negative generator gives up on some valid documents (seen on POST /jobs with 4.32.5:
        # "Cannot generate an array with 1 demanded elements", upstream schemathesis#4282/#4440); the invalid
        # bodies of that route are replayed one by one in tests/test_api_inputs.py
        print(f"[schemathesis] no invalid cases for {operation.label}: {exc}")


def _error(response: Any) -> str:
    try:
        return str(response.json().get("error", ""))
    except ValueError:
        return ""


def test_every_route_of_the_app_is_in_the_document(client: BackendClient) -> None:
    """The document the backend serves and its routes come from one table (aibro_core/routes.py): every route the
    app serves is in the document."""
    from aibro_backend.server.routes import routes

    paths = client.t.json("GET", "/openapi.json")["paths"]
    documented = [re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$") for path in paths]
    samples = {r"([^/]+)": "a" * 64, r"([\w-]+)": "job-x", r"(.+)": "model.keras", r"([0-9a-f]{64})": "a" * 64}
    for pattern, *_ in routes(_FakeBackend()):
        path = pattern.removeprefix("/api/v1")
        for group, sample in samples.items():
            path = path.replace(group, sample)
        path = re.sub(r"\\(.)", r"\1", path)  # the table's patterns escape literal characters (openapi\.json)
        assert any(d.match(path) for d in documented), f"{pattern} is served but not in the OpenAPI document"


class _FakeBackend:
    """routes() only puts the backend into handler arguments."""
