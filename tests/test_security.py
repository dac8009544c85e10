"""Tokens on every route, one user never sees another's jobs, blobs or instances, secrets are 0600."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
import requests

from aibro_backend.store import Store
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient

from conftest import make_model

SHA = "a" * 64
ROUTES = [
    ("GET", "/health"), ("GET", "/machines"), ("GET", "/policy"), ("GET", "/stats"), ("POST", "/auth/tokens"),
    ("HEAD", f"/blobs/{SHA}"), ("PUT", f"/blobs/{SHA}?offset=0&total=1"), ("GET", "/jobs"), ("POST", "/jobs"),
    ("GET", "/jobs/job-x"), ("POST", "/jobs/job-x/cancel"), ("POST", "/jobs/job-x/replay"),
    ("GET", "/jobs/job-x/events"), ("GET", "/events"), ("GET", "/jobs/job-x/artifacts"),
    ("GET", "/jobs/job-x/artifacts/model.keras"), ("GET", "/instances"), ("POST", "/instances/i-x/terminate"),
    ("GET", "/openapi.json"), ("GET", "/worker/assignment"), ("GET", f"/worker/blobs/{SHA}"),
    ("POST", "/worker/jobs/job-x/events"), ("PUT", "/worker/jobs/job-x/artifacts/model.keras"),
    ("POST", "/worker/jobs/job-x/finish"),
]


@pytest.mark.parametrize("token", [None, "wrong"])
def test_every_route_needs_a_token(client: BackendClient, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for method, path in ROUTES:
        resp = requests.request(method, f"{client.url}/api/v1{path}", headers=headers, timeout=10)
        assert resp.status_code == 401, (method, path, resp.status_code)
        if method != "HEAD":
            assert "token" in resp.json()["error"], (method, path)


def test_user_token_is_not_a_worker_token(client: BackendClient) -> None:
    resp = requests.get(f"{client.url}/api/v1/worker/assignment", headers={"Authorization": f"Bearer {client.t.token}"})
    assert resp.status_code == 401


def test_secrets_are_private_and_backend_binds_loopback(client: BackendClient, aibro_home: Path) -> None:
    assert client.url.startswith("http://127.0.0.1:")
    for name in ("backend.json", "credentials.json"):
        assert stat.S_IMODE((aibro_home / name).stat().st_mode) == 0o600


def test_openapi_document(client: BackendClient) -> None:
    doc = client.t.json("GET", "/openapi.json")
    assert doc["openapi"].startswith("3.")
    for path in ("/jobs", "/jobs/{job_id}/events", "/blobs/{sha256}", "/events", "/instances"):
        assert path in doc["paths"], path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_users_are_isolated(client: BackendClient, aibro_home: Path, digits) -> None:  # noqa: ANN001
    store = Store(aibro_home / "state" / "aibro.db")
    bob = BackendClient(client.url, store.new_token(store.ensure_user("bob")))
    store.close()
    x, y, _, _ = digits
    trainer = Training(client)
    job = trainer.submit(make_model(), x[:64], y[:64], machine_ids="local-cpu", epochs=2, cool_down_period_s=600)
    job_id = job["job_id"]
    trainer.watch(job_id)
    assert job_id not in [j["job_id"] for j in bob.jobs()]
    for method, path in [("GET", f"/jobs/{job_id}"), ("GET", f"/jobs/{job_id}/events"),
                         ("GET", f"/jobs/{job_id}/artifacts"), ("GET", f"/jobs/{job_id}/artifacts/model.keras"),
                         ("POST", f"/jobs/{job_id}/cancel"), ("POST", f"/jobs/{job_id}/replay")]:
        resp = bob.t.session.request(method, f"{client.url}/api/v1{path}")
        assert resp.status_code == 404, (method, path)
    assert bob.t.json("GET", "/events")["events"] == []
    assert bob.instances() == []
    mine = [i["id"] for i in client.instances()]
    assert mine
    for inst in mine:
        assert bob.t.session.post(f"{client.url}/api/v1/instances/{inst}/terminate").status_code == 404
    # local's blobs: bob cannot see them, nor use them without sending the bytes himself
    spec_sha = _uploaded_sha(client, x[:64])
    head = bob.t.request("HEAD", f"/blobs/{spec_sha}")
    assert head.status_code == 404 and head.headers["X-Received"] == "0"
    spec = {"model": spec_sha, "data": {"x": {"blob": spec_sha}}, "fit": {"epochs": 1}, "machines": ["local-cpu"]}
    resp = bob.t.session.post(f"{client.url}/api/v1/jobs", json=spec)
    assert resp.status_code == 400 and "not uploaded by this user" in resp.json()["error"]


def _uploaded_sha(client: BackendClient, arr) -> str:  # noqa: ANN001
    """The digest of the .npy blob `arr` was uploaded as (the same encoding the bundle uses)."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    sha = hashlib.sha256(buf.getvalue()).hexdigest()
    assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 200
    return sha
