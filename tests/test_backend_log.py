"""The backend's log says what needs acting on: a normal "not uploaded yet" HEAD is not a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from backend_proc import own_backend


def test_a_missing_blob_head_is_not_a_warning_but_a_bad_token_is(tmp_path: Path) -> None:
    home = tmp_path / "quiet"
    with own_backend(home) as backend:
        client = backend.client()
        assert client.t.request("HEAD", "/blobs/" + "ab" * 32).status_code == 404
        with pytest.raises(Exception):  # noqa: B017 - any refusal; the log line is what is checked
            backend.client("aibro_u_not-a-token").health()
        log = backend.log
    text = log.read_text()
    assert "HEAD /api/v1/blobs/" not in text, "a normal 404 HEAD is logged at DEBUG, below the log's level"
    assert "401 GET /api/v1/health" in text and logging.getLevelName(logging.WARNING) in text, text[-2000:]
