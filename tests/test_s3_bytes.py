"""Bytes through S3 when the AWS provider is on (issue 11 item 5), against moto's server: the client uploads its
data and model on presigned URLs (multipart over AIBRO_S3_PART_BYTES), the worker on a played EC2 instance
downloads them and uploads its checkpoints, TensorBoard logs and model the same way, and the backend's own blob
directory never holds a training byte. An upload is its user's at once and shared once S3 has proven its name; the
same data again uploads 0 bytes; bytes that do not hash to their name are never shared and leave the user's index;
another user gets no URL for the first user's blobs or job."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import pytest
import requests
from aws_moto import PlayedInstances, make_account, moto_server, write_config  # noqa: E402
from backend_proc import own_backend  # noqa: E402

from aibro_backend.providers.aws_config import load_aws_config  # noqa: E402
from aibro_core import vocabulary as v  # noqa: E402
from aibro_core.errors import ApiError  # noqa: E402
from aibro_core.models import JobSpec  # noqa: E402
from aibro_jupyter import Training, blobsource  # noqa: E402
from aibro_jupyter.blobsource import ArraySource, BytesSource  # noqa: E402
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model  # noqa: E402
from helpers import backend_db, slow_data, wait_for, wait_until  # noqa: E402

REFUTED = r"aibro_backend\.storage\.claims WARNING user \d+'s upload \S+ is not the blob [0-9a-f]{64} it was named"
PART = 5 * 1024 * 1024  # S3's smallest part: the test's arrays are a little over it
PREFIX = "jobs/"


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One backend with the AWS provider (S3 parts of 5 MiB), its played instances, and a second user."""
    root = tmp_path_factory.mktemp("s3bytes")
    with moto_server() as env:
        account = make_account()
        config = write_config(root / "aws.toml", account)
        backend_id = load_aws_config(config).backend_id
        home = root / "home"
        args = ("--provider", "aws", "--aws-config", str(config))
        with own_backend(home, *args, AIBRO_S3_PART_BYTES=str(PART), **env) as b:
            with PlayedInstances(backend_id, b.url, root / "machines", env) as played:
                other = b.add_user("mallory")
                s3 = account["session"].client("s3")
                yield {"backend": b, "played": played, "s3": s3, "bucket": account["bucket"], "other": other}


def _keys(aws: dict[str, Any], under: str) -> dict[str, int]:
    pages = aws["s3"].get_paginator("list_objects_v2").paginate(Bucket=aws["bucket"], Prefix=PREFIX + under)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _object_sha(aws: dict[str, Any], key: str) -> str:
    body = aws["s3"].get_object(Bucket=aws["bucket"], Key=key)["Body"].read()
    return hashlib.sha256(body).hexdigest()


def _claim(aws: dict[str, Any], sha: str, user: str = "local") -> list[tuple]:
    """The user's index row for `sha` once the backend's publish of their upload is over: [(s3_key,)] with None
    for a proven and shared one, [] for a claim that was refused (or nothing held)."""
    home = aws["backend"].home
    sql = "SELECT b.s3_key FROM blobs b JOIN users u ON u.id = b.user_id WHERE b.sha=? AND u.name=?"

    def settled() -> tuple[list[tuple]] | None:
        rows = backend_db(home, sql, sha, user)
        return (rows,) if not rows or rows[0][0] is None else None  # a tuple: an empty answer is an answer too

    got = wait_until(settled)
    assert got is not None, f"the upload of {sha} was neither proven nor refused"
    return got[0]


def _upload_path() -> str:
    return f"/blobs/uploads/{secrets.token_hex(16)}/upload"


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _big_data() -> tuple[Any, Any]:
    """An x of about 5.6 MB: over one part, so it goes as a multipart upload."""
    x, y = slow_data(22_000, seed=5)
    assert x.nbytes > PART
    return x, y


def test_a_job_on_a_played_ec2_instance_keeps_its_data_checkpoints_and_model_in_s3(
    aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = aws["backend"]
    client = b.client()
    monkeypatch.setenv("AIBRO_BACKEND_URL", b.url)
    monkeypatch.setenv("AIBRO_TOKEN", b.token)
    x, y = _big_data()
    job_id, trained, history = Training.online_fit(
        make_model(), x, y, machine_ids="g4dn.xlarge.od", batch_size=256, epochs=2, record=False
    )
    assert len(history.history["loss"]) == 2
    job = client.job(job_id)
    assert job.status == v.COMPLETED and job.machine_id == "g4dn.xlarge.od"

    # The data and the model the client sent: once proven, content-addressed keys holding bytes that hash to their
    # names; the uploads themselves go once no URL to them can be in use.
    spec = _spec(b, job_id)
    shas = {spec["model"], *_spec_shas(spec["data"])}
    assert all(_claim(aws, sha) == [(None,)] for sha in shas)
    blobs = _keys(aws, "blobs/")
    for sha in shas:
        assert PREFIX + "blobs/" + sha in blobs, (sha, blobs)
        assert _object_sha(aws, PREFIX + "blobs/" + sha) == sha
    assert ArraySource(x).sha256() in shas
    doomed = {k for (k,) in backend_db(b.home, "SELECT key FROM s3_doomed")}
    assert set(_keys(aws, "uploads/")) <= doomed, "every upload is due to go"

    # What the worker sent back: every artifact but the backend's own history.json is a key of the job.
    arts = {a.name: a for a in client.artifacts(job_id)}
    assert "model.keras" in arts and any(n.startswith("checkpoints/") for n in arts), arts
    assert any(n.startswith("tensorboard/") for n in arts), arts
    keys = _keys(aws, f"jobs/{job_id}/")
    for name, art in arts.items():
        if name != "history.json":
            key = f"{PREFIX}jobs/{job_id}/{name}"
            assert keys.get(key) == art.size, (name, keys)
            assert _object_sha(aws, key) == art.sha

    # Downloads follow the backend's redirect to S3: the bytes are the artifact's.
    got = client.download_artifact(job_id, "model.keras", b.home.parent / "model-back.keras")
    assert hashlib.sha256(got.read_bytes()).hexdigest() == arts["model.keras"].sha

    # The backend relayed none of it: its blob directory holds only the history it wrote itself.
    store = b.home / "state" / "blobs"
    assert _files(store / "blobs") == [] and _files(store / "partial") == []
    assert _files(store / "artifacts") == [f"{job_id}/history.json"]
    counters = client.counters()
    assert counters.get("blob_bytes_received", 0) == 0
    assert counters["blob_bytes_s3"] == sum(blobs[PREFIX + "blobs/" + s] for s in shas)


def _spec(b: Any, job_id: str) -> dict[str, Any]:
    """The job's stored spec (the API shows a view of it, not the blob names)."""
    return json.loads(backend_db(b.home, "SELECT spec FROM jobs WHERE id=?", job_id)[0][0])


def _spec_shas(data: Any) -> list[str]:
    """Every sha256 in a job spec's data section."""
    if isinstance(data, dict):
        return [s for value in data.values() for s in _spec_shas(value)]
    if isinstance(data, list):
        return [s for value in data for s in _spec_shas(value)]
    return [data] if isinstance(data, str) and re.fullmatch(r"[0-9a-f]{64}", data) else []


def test_an_array_over_the_part_size_goes_as_a_multipart_upload(aws: dict[str, Any]) -> None:
    """The parts go to the user's own upload key (never `blobs/`), the blob is theirs as soon as the upload is
    complete, and the shared `blobs/<sha>` holds it once S3 has hashed a frozen copy of it."""
    client = aws["backend"].client()
    x = slow_data(21_000, seed=11)[0]
    source = ArraySource(x)
    sha = source.sha256()
    plan = client.t.json("POST", _upload_path(), json={"action": "start", "size": source.size})
    assert plan["via"] == "s3" and plan["upload_id"], plan
    assert [p["size"] for p in plan["parts"]] == [PART, source.size - PART]
    assert all(f"/{PREFIX}uploads/" in p["url"] and "/blobs/" not in p["url"] for p in plan["parts"])
    assert client.upload_source(source, sha) == (sha, source.size)
    assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 200, "the user's at once"
    assert _claim(aws, sha) == [(None,)], "proven and shared"
    assert _object_sha(aws, PREFIX + "blobs/" + sha) == sha
    assert client.upload_source(source, sha) == (sha, 0), "the same data again uploads nothing"


def test_new_data_goes_to_s3_in_one_pass_hashed_while_it_goes(
    aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large array never sent before: its parts go to S3 in parallel with no SHA-256 pass before them (a thread
    hashes them as they go); the blob is the user's under that digest at once, read from their own upload key by
    their jobs until the backend has had S3 prove it, then from the shared `blobs/<sha>`."""
    client = aws["backend"].client()
    monkeypatch.setattr(blobsource, "ONE_PASS_MIN", 1 << 20)  # the test's arrays are small
    x = slow_data(23_000, seed=13)[0]
    expected = ArraySource(x).sha256()
    monkeypatch.setattr(ArraySource, "sha256", lambda self: pytest.fail("the kernel hashed new data first"))
    sha, sent = client.upload_array(x)
    assert sha == expected and sent == ArraySource(x).size
    assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 200, "held by this user"
    assert _claim(aws, sha) == [(None,)]
    assert _object_sha(aws, PREFIX + "blobs/" + sha) == sha
    (upload,) = [k for k in _keys(aws, "uploads/") if _object_sha(aws, k) == sha]
    due = backend_db(aws["backend"].home, "SELECT after FROM s3_doomed WHERE key=?", upload)
    assert due and due[0][0] > time.time() + 600, "the upload's key goes once no URL to it can be in use"


def test_the_same_data_again_uploads_nothing_and_a_local_job_also_uses_s3(aws: dict[str, Any]) -> None:
    """A second job with the same data sends only its (new) model; it runs on the local provider of the same
    backend, whose bytes also travel through S3 (one blob store, one backing)."""
    client = aws["backend"].client()
    x, y = _big_data()
    before = client.counters().get("blob_bytes_s3", 0)
    model = make_model(seed=3)
    job = Training(client).submit(FitRequest(model, x, y, machine_ids="local-cpu", epochs=1, batch_size=256))
    sent = client.counters().get("blob_bytes_s3", 0) - before
    head = client.t.request("HEAD", f"/blobs/{_spec(aws['backend'], job.job_id)['model']}")
    assert sent == int(head.headers["X-Blob-Size"]), "only the model was uploaded: the data was there already"
    wait_for(client, job.job_id, lambda evs: client.job(job.job_id).status in v.JOB_FINAL, timeout=600)
    assert client.job(job.job_id).status == v.COMPLETED
    assert f"{PREFIX}jobs/{job.job_id}/model.keras" in _keys(aws, f"jobs/{job.job_id}/")
    assert _files(aws["backend"].home / "state" / "blobs" / "blobs") == []


@pytest.mark.backend_log(REFUTED)
def test_bytes_that_do_not_hash_to_their_name_are_never_shared_and_leave_the_index(aws: dict[str, Any]) -> None:
    """A client (not this one) naming its upload wrongly fools only itself, and not for long: S3's digest of the
    upload refutes the name, the blob leaves that user's index, nothing is written under the name, and the real
    bytes upload as usual."""
    client = aws["backend"].client()
    good = BytesSource(b"the real bytes " * 1000)
    sha = good.sha256()
    path = _upload_path()
    plan = client.t.json("POST", path, json={"action": "start", "size": good.size, "sha256": sha})
    (part,) = plan["parts"]
    assert part["headers"]["x-amz-checksum-sha256"], "real S3 checks a single PUT against the name too"
    # moto does not check that header; the backend's own check (S3's SHA-256 of a frozen copy) still holds.
    assert requests.put(part["url"], data=b"x" * good.size, headers=part["headers"], timeout=60).status_code == 200
    before = client.counters().get("blob_claims_refused", 0)
    done = client.t.json("POST", path, json={"action": "finish", "size": good.size, "sha256": sha})
    assert done["complete"] and done["sha256"] == sha
    assert _claim(aws, sha) == [], "refuted: no longer this user's"
    assert client.counters().get("blob_claims_refused", 0) == before + 1
    assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 404
    assert PREFIX + "blobs/" + sha not in _keys(aws, "blobs/")
    assert client.upload_source(good, sha) == (sha, good.size)
    assert _claim(aws, sha) == [(None,)]
    assert _object_sha(aws, PREFIX + "blobs/" + sha) == sha


def test_finishing_an_s3_upload_needs_its_digest(aws: dict[str, Any]) -> None:
    client = aws["backend"].client()
    path = _upload_path()
    client.t.json("POST", path, json={"action": "start", "size": 3})
    with pytest.raises(ApiError) as refused:
        client.t.json("POST", path, json={"action": "finish", "size": 3})
    assert refused.value.status == 400 and "'sha256'" in str(refused.value)


@pytest.mark.backend_log(REFUTED)
def test_another_user_gets_no_url_for_the_first_users_blob_or_job(aws: dict[str, Any]) -> None:
    alice, mallory = aws["backend"].client(), aws["other"]
    source = BytesSource(b"alice's data " * 500)
    sha, _ = alice.upload_source(source, source.sha256())
    assert _claim(aws, sha) == [(None,)]
    job_id = next(j.job_id for j in alice.jobs() if j.status == v.COMPLETED)
    key = PREFIX + "blobs/" + sha

    assert mallory.t.request("HEAD", f"/blobs/{sha}").status_code == 404, "knowing the digest grants nothing"
    path = _upload_path()
    plan = mallory.t.json("POST", path, json={"action": "start", "size": source.size})
    assert all(key not in p["url"] and "/uploads/" in p["url"] for p in plan["parts"]), "only her own upload key"
    # Mallory's other bytes under alice's name: hers alone until refuted, and alice's blob keeps its bytes.
    (part,) = plan["parts"]
    requests.put(part["url"], data=b"m" * source.size, headers=part["headers"], timeout=60)
    mallory.t.json("POST", path, json={"action": "finish", "size": source.size, "sha256": sha})
    assert _claim(aws, sha, "mallory") == [], "refuted"
    assert _object_sha(aws, key) == sha
    assert _claim(aws, sha) == [(None,)], "alice still holds hers"
    for path in (f"/jobs/{job_id}/artifacts/model.keras", f"/jobs/{job_id}/artifacts"):
        with pytest.raises(ApiError) as hidden:
            mallory.t.request("GET", path, allow_redirects=False)
        assert hidden.value.status == 404
    # Nor does a job of hers name alice's blob: submitting one she does not hold is refused.
    with pytest.raises(ApiError, match="was not uploaded by this user"):
        mallory.submit(JobSpec.model_validate({**_spec(aws["backend"], job_id), "description": "borrowed"}))


def test_the_local_backend_keeps_bytes_on_disk(tmp_path: Path) -> None:
    """Without the AWS provider nothing changes: no X-Upload-Via, and the S3 upload route says how to upload."""
    with own_backend(tmp_path / "home") as b:
        client = b.client()
        source = BytesSource(b"local bytes")
        sha = source.sha256()
        head = client.t.request("HEAD", f"/blobs/{sha}")
        assert head.status_code == 404 and "X-Upload-Via" not in head.headers
        assert client.upload_source(source, sha) == (sha, source.size)
        assert (b.home / "state" / "blobs" / "blobs" / sha).read_bytes() == b"local bytes"
        with pytest.raises(ApiError) as refused:
            client.t.json("POST", _upload_path(), json={"action": "start", "size": 1})
        assert refused.value.status == 409 and "PUT /blobs/" in str(refused.value)
