"""No submit leaves its temporary bundle directory (`aibro-bundle-*`) behind, whether it succeeds or fails early,
late, or inside the upload. Each case runs against the real embedded backend with its own temp dir."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aibro_core.errors import BackendUnreachable, ValidationError
from aibro_core.vocabulary import COMPLETED
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model

pytestmark = pytest.mark.fast


@pytest.fixture
def tmpdir_of_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty temp dir for everything this process puts in the temp dir; asserts it holds no aibro-*."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    left = sorted(p.name for p in d.iterdir() if p.name.startswith("aibro"))
    assert not left, f"temporary directories left behind: {left}"


@pytest.fixture
def own_client(client: BackendClient) -> BackendClient:
    """A client of the shared embedded backend that a test may monkeypatch without touching the shared one."""
    return BackendClient(client.url, client.t.token)


def _data(n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(secrets.randbits(64))  # fresh bytes: content addressing cannot skip the upload
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n).astype("int32")


def test_successful_submit_and_collect(own_client: BackendClient, tmpdir_of_submit: Path) -> None:
    x, y = _data()
    trainer = Training(own_client)
    job = trainer.submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1, batch_size=64))
    assert not list(tmpdir_of_submit.glob("aibro-bundle-*")), "the bundle is gone as soon as submit returns"
    view = trainer.watch(job.job_id)
    assert view.status == COMPLETED, view.errors
    model, history = trainer.collect(view, make_model())
    assert history.epoch == [0]


def test_unknown_machine_fails_before_encoding(own_client: BackendClient, tmpdir_of_submit: Path) -> None:
    x, y = _data()
    with pytest.raises(ValidationError, match="unknown machine"):
        Training(own_client).submit(FitRequest(make_model(), x, y, machine_ids="no-such-machine"))


def test_mismatched_lengths_fail_while_encoding(own_client: BackendClient, tmpdir_of_submit: Path) -> None:
    x, y = _data()
    with pytest.raises(ValidationError):
        Training(own_client).submit(FitRequest(make_model(), x, y[:-3], machine_ids="local-cpu"))


@pytest.mark.parametrize("limit", [4_000, 70_000], ids=["data-over-limit", "model-over-limit"])
def test_over_the_limit_fails_after_encoding(
    own_client: BackendClient, tmpdir_of_submit: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """256 x 64 float32 is about 66 kB of data: a 4 kB limit refuses it after encoding; a 70 kB limit lets the
    data pass and refuses data plus model once the model is saved into the bundle too."""
    x, y = _data()
    policy = own_client.policy().model_copy(update={"max_job_bytes": limit})
    monkeypatch.setattr(own_client, "policy", lambda: policy)
    with pytest.raises(ValidationError, match=f"over the {limit}-byte limit"):
        Training(own_client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu"))


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), BackendUnreachable("gone mid-upload")])
def test_failure_inside_the_upload(
    own_client: BackendClient, tmpdir_of_submit: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    """The upload's first blob request raises (at the transport, whichever upload method the submit uses)."""
    x, y = _data()
    calls: list[str] = []
    send = own_client.t.send

    def failing_send(method: str, path: str, **kw: Any) -> Any:
        if path.startswith("/blobs/"):
            calls.append(f"{method} {path}")
            raise exc
        return send(method, path, **kw)

    monkeypatch.setattr(own_client.t, "send", failing_send)
    with pytest.raises(type(exc), match=str(exc)):
        Training(own_client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu"))
    assert calls, "the submit got as far as the upload"
