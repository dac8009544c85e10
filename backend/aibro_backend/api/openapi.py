"""The OpenAPI document of the v1 API, served at /api/v1/openapi.json."""

from __future__ import annotations

from typing import Any

from .base import UserHandler

ROUTES: list[tuple[str, str, str]] = [
    ("get", "/health", "who the token belongs to and the backend version"),
    ("get", "/machines", "the marketplace: every machine this backend can start"),
    ("get", "/policy", "per-user limits"),
    ("get", "/stats", "per-user counters (bytes received, ...)"),
    ("post", "/auth/tokens", "a new token for the calling user"),
    ("head", "/blobs/{sha256}", "200 if this user holds the blob, else 404 with X-Received for resuming"),
    ("put", "/blobs/{sha256}", "one chunk of a content-addressed upload (?offset=&total=)"),
    ("get", "/jobs", "the user's jobs"),
    ("post", "/jobs", "submit a job spec"),
    ("get", "/jobs/{job_id}", "one job: status, substatus, progress, timeline"),
    ("post", "/jobs/{job_id}/cancel", "cancel a job; the worker stops within about one batch"),
    ("post", "/jobs/{job_id}/replay", "run a recorded job again"),
    ("get", "/jobs/{job_id}/events", "the job's event log after ?after=SEQ, long-polling up to ?wait=S"),
    ("get", "/events", "all of the user's events after the cursor ?after=GID, long-polling up to ?wait=S"),
    ("get", "/jobs/{job_id}/artifacts", "the job's artifacts"),
    ("get", "/jobs/{job_id}/artifacts/{name}", "download one artifact"),
    ("get", "/instances", "the user's instances with their state history"),
    ("post", "/instances/{instance_id}/terminate", "close a cooling instance now"),
    ("get", "/openapi.json", "this document"),
]


def document() -> dict[str, Any]:
    from .. import __version__

    paths: dict[str, Any] = {}
    for method, path, summary in ROUTES:
        params = [
            {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
            for n in ("sha256", "job_id", "name", "instance_id")
            if "{" + n + "}" in path
        ]
        paths.setdefault(path, {})[method] = {
            "summary": summary,
            "parameters": params,
            "security": [{"bearer": []}],
            "responses": {"200": {"description": "OK"}, "401": {"description": "missing or invalid token"}},
        }
    return {
        "openapi": "3.0.3",
        "info": {"title": "aibro backend", "version": __version__},
        "servers": [{"url": "/api/v1"}],
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }


class OpenApiHandler(UserHandler):
    def get(self) -> None:
        self.send(document())
