"""The OpenAPI 3.1 document of the v1 API, generated from the models in `models.py`; served at /api/v1/openapi.json.

Each route below names its parameters, its request body and every status it answers with the model of that
answer; the JSON Schemas come from pydantic, so what the document promises is what the handlers check.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import models as m
from .base import UserHandler

REF = "#/components/schemas/{model}"
ERROR_TEXT = {
    400: "the request is malformed: the message names the field and the fix",
    401: "no token, or one this backend does not know",
    403: "the token may not reach this resource",
    404: "no such resource for this token",
    409: "the request conflicts with the resource's state",
    411: "an upload without Content-Length",
    413: "over a size limit (per job, per chunk or per body)",
    429: "over a per-user limit (active jobs, tokens, uploads): the message says which and how to free one",
    507: "the backend could not store the upload",
}
PATH_PARAMS: dict[str, dict[str, Any]] = {
    "sha256": {"type": "string", "pattern": m.SHA_PATTERN, "description": "a blob's sha256 hex digest"},
    "job_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "a job id, e.g. job-20250101-1a2b3c4d"},
    "instance_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "an instance id"},
    "upload_id": {"type": "string", "pattern": m.UPLOAD_ID_PATTERN, "description": "an unnamed upload's id"},
    "token_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "a token's public id"},
    "name": {"type": "string", "pattern": m.ARTIFACT_NAME_PATTERN, "description": "an artifact name"},
}


@dataclass
class Route:
    method: str
    path: str
    summary: str
    ok: type[BaseModel] | str | None  # a model, "binary" (octet-stream), or None (no body, e.g. HEAD)
    errors: tuple[int, ...] = ()
    body: type[BaseModel] | str | None = None  # a model, "binary", or "chunk" (octet-stream of at least one byte)
    query: type[BaseModel] | None = None
    status: int = 200
    security: str = "bearer"
    headers: dict[int, dict[str, str]] = field(default_factory=dict)


TRANSFER_ERRORS = (400, 403, 404, 409, 411, 413, 429, 507)
ROUTES: list[Route] = [
    Route("get", "/health", "who the token belongs to and the backend version", m.Health),
    Route("get", "/machines", "the marketplace: every machine this backend can start", m.Machines),
    Route("get", "/policy", "per-user limits", m.Policy),
    Route("get", "/stats", "per-user counters (bytes received, ...)", m.Stats),
    Route("get", "/auth/tokens", "the caller's live tokens (ids and times, never a secret)", m.Tokens),
    Route(
        "post", "/auth/tokens", "a new token for the calling user", m.TokenMinted, (400, 429), m.TokenMint, None, 201
    ),
    Route("delete", "/auth/tokens/{token_id}", "revoke one of the caller's tokens", m.TokenRevoked, (404,)),
    Route(
        "head",
        "/blobs/{sha256}",
        "200 (X-Blob-Size) if this user holds the blob, else 404 with X-Received: the bytes a resumed upload skips",
        None,
        (400, 404),
        headers={
            200: {"X-Blob-Size": "the blob's size"},
            404: {
                "X-Received": "bytes of a partial upload",
                "X-Upload-Via": "'s3' when this backend keeps bytes in S3: POST /blobs/{sha256}/upload instead",
            },
        },
    ),
    Route(
        "post",
        "/blobs/{sha256}/upload",
        "S3 backing: presigned PUT URL(s) for the blob (start), then complete, verify and index it (finish)",
        m.UploadPlan,
        (400, 409, 413),
        m.S3Upload,
    ),
    Route(
        "put",
        "/blobs/{sha256}",
        "one chunk of a content-addressed, resumable upload at ?offset= of a blob of ?total= bytes",
        m.BlobProgress,
        TRANSFER_ERRORS,
        "binary",
        m.BlobQuery,
    ),
    Route(
        "delete",
        "/blobs/{sha256}",
        "drop this user's unfinished upload of the blob (frees its quota); a complete blob stays",
        m.BlobDropped,
        (400, 409),
    ),
    Route(
        "head",
        "/blobs/uploads/{upload_id}",
        "X-Received: the bytes of this unnamed upload already here (a resumed upload starts there)",
        None,
        (400,),
        headers={200: {"X-Received": "bytes received", "X-Upload-Via": "'s3' when uploads go to S3 instead"}},
    ),
    Route(
        "put",
        "/blobs/uploads/{upload_id}",
        "one chunk of a one-pass upload (the client hashes as it sends and names the blob at the end)",
        m.BlobProgress,
        TRANSFER_ERRORS,
        "chunk",
        m.BlobQuery,
    ),
    Route(
        "delete",
        "/blobs/uploads/{upload_id}",
        "drop this user's unfinished unnamed upload (frees its quota)",
        m.BlobDropped,
        (400, 409),
    ),
    Route(
        "post",
        "/blobs/uploads/{upload_id}/finish",
        "a complete unnamed upload becomes the blob named by the backend's digest (equal to sha256 when given)",
        m.BlobNamed,
        (400, 409, 413),
        m.NameUpload,
    ),
    Route("get", "/jobs", "the user's jobs, and the event cursor to follow from", m.Jobs),
    Route("post", "/jobs", "submit a job spec", m.Job, (400, 413, 429), m.JobSpec, None, 201),
    Route("get", "/jobs/{job_id}", "one job: status, substatus, progress, timeline", m.Job, (404,)),
    Route("post", "/jobs/{job_id}/cancel", "cancel a job; the worker stops within about one batch", m.Job, (404,)),
    Route(
        "post",
        "/jobs/{job_id}/replay",
        "run a recorded job again, optionally on other machines or with another description",
        m.Job,
        (400, 404, 409, 413, 429),
        m.ReplayOverrides,
        None,
        201,
    ),
    Route(
        "get",
        "/jobs/{job_id}/events",
        "the job's event log after ?after=SEQ, long-polling up to ?wait=S when there is none yet",
        m.JobEvents,
        (400, 404),
        None,
        m.EventsQuery,
    ),
    Route(
        "get",
        "/events",
        "all of the user's events after the cursor ?after=GID, long-polling up to ?wait=S",
        m.UserEvents,
        (400,),
        None,
        m.EventsQuery,
    ),
    Route("get", "/jobs/{job_id}/artifacts", "the job's artifacts", m.Artifacts, (404,)),
    Route("get", "/jobs/{job_id}/artifacts/{name}", "download one artifact", "binary", (400, 404)),
    Route("get", "/instances", "the user's instances with their state history", m.Instances),
    Route(
        "post",
        "/instances/{instance_id}/terminate",
        "terminate a cooling or stopped instance now",
        m.InstanceAnswer,
        (404, 409),
    ),
    Route("get", "/openapi.json", "this document", m.OpenApiDocument),
    Route(
        "post",
        "/worker/enroll",
        "exchange the one-time enrollment token (bearer or body) for this instance's worker token, answered once",
        m.WorkerEnrolled,
        (400,),
        m.WorkerEnroll,
        security="enroll",
    ),
    Route("get", "/worker/assignment", "what this instance does next", m.Assignment, (), security="worker"),
    Route(
        "get",
        "/worker/blobs/{sha256}",
        "a blob of the job assigned to this instance",
        "binary",
        (403, 404),
        security="worker",
    ),
    Route(
        "post",
        "/worker/jobs/{job_id}/events",
        "the worker's numbered events; a refused batch names the bad event's wseq",
        m.EventsAck,
        (400, 409),
        m.WorkerEvents,
        security="worker",
    ),
    Route(
        "get",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "an artifact of the assigned job (a checkpoint to resume from)",
        "binary",
        (400, 404, 409),
        security="worker",
    ),
    Route(
        "head",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "how much of an unfinished artifact upload is here (X-Received), to resume it",
        None,
        (400, 409),
        None,
        m.AttemptQuery,
        security="worker",
        headers={200: {"X-Received": "bytes of the unfinished upload"}},
    ),
    Route(
        "put",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "upload an artifact of the assigned job, whole or in chunks (?attempt=&offset=&total=)",
        m.ArtifactStored,
        TRANSFER_ERRORS,
        "binary",
        m.ArtifactChunkQuery,
        security="worker",
    ),
    Route(
        "post",
        "/worker/jobs/{job_id}/uploads/{name}",
        "S3 backing: presigned PUT URL(s) for an artifact of the assigned job (start), then index it (finish)",
        m.UploadPlan,
        (400, 409, 413),
        m.S3Upload,
        security="worker",
    ),
    Route(
        "post",
        "/worker/jobs/{job_id}/finish",
        "the attempt's outcome",
        m.Ok,
        (400, 409),
        m.WorkerFinish,
        security="worker",
    ),
]

EXTRA_SCHEMAS: tuple[type[BaseModel], ...] = ()


def _models() -> list[tuple[type[BaseModel], str]]:
    found: list[tuple[type[BaseModel], str]] = [(m.ErrorBody, "serialization")]
    for r in ROUTES:
        if isinstance(r.ok, type):
            found.append((r.ok, "serialization"))
        if isinstance(r.body, type):
            found.append((r.body, "validation"))
    found += [(model, "validation") for model in EXTRA_SCHEMAS]
    return list(dict.fromkeys(found))


def _query_params(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema()
    required = set(schema.get("required", []))
    out = []
    for name, prop in schema["properties"].items():
        prop = dict(prop)
        description = prop.pop("description", "")
        prop.pop("title", None)
        param = {"name": name, "in": "query", "required": name in required, "schema": prop}
        if description:
            param["description"] = description
        out.append(param)
    return out


def _content(kind: type[BaseModel] | str, refs: dict[tuple[type[BaseModel], str], Any], mode: str) -> dict:
    if kind == "binary":
        return {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    if kind == "chunk":  # an unnamed upload has no name to give empty data: its chunks carry bytes
        return {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}}}
    return {"application/json": {"schema": refs[(kind, mode)]}}


def _unrolled_data_tree(schemas: dict[str, Any]) -> dict[str, Any]:
    """DataNode refers to itself; the document spells its levels out instead (DataNode, DataNode2, ...,
    DataNode{MAX_TREE_DEPTH}, whose nodes are arrays only). That states the depth limit the backend enforces, and a
    schema without a cycle is one every generator and validator handles (schemathesis 4.32 failed on the cycle)."""
    node = schemas.get("DataNode")
    if node is None:
        return schemas

    def level(depth: int) -> str:
        return "DataNode" if depth == 1 else f"DataNode{depth}"

    def pointing_to(schema: dict[str, Any], target: str) -> dict[str, Any]:
        out = copy.deepcopy(schema)
        props = out["properties"]
        props["list"]["items"] = {"$ref": REF.format(model=target)}
        props["dict"]["additionalProperties"] = {"$ref": REF.format(model=target)}
        return out

    for depth in range(1, m.MAX_TREE_DEPTH):
        schemas[level(depth)] = pointing_to(node, level(depth + 1))
        schemas[level(depth)]["title"] = level(depth)
    leaf = copy.deepcopy(node)
    leaf["properties"] = {k: v for k, v in leaf["properties"].items() if k not in ("list", "dict")}
    del leaf["oneOf"]
    leaf["required"] = ["blob"]
    leaf["title"] = level(m.MAX_TREE_DEPTH)
    leaf["description"] = f"An array: a data tree's level {m.MAX_TREE_DEPTH}, its deepest, holds arrays only."
    schemas[level(m.MAX_TREE_DEPTH)] = leaf
    top = schemas.get("DataTop")
    if top is not None:
        schemas["DataTop"] = pointing_to(top, level(2))
    return schemas


@functools.lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    from .. import __version__

    refs, defs = models_json_schema(_models(), ref_template=REF)
    error = {"application/json": {"schema": refs[(m.ErrorBody, "serialization")]}}
    paths: dict[str, Any] = {}
    for r in ROUTES:
        params = [
            {"name": name, "in": "path", "required": True, "schema": schema}
            for name, schema in PATH_PARAMS.items()
            if "{" + name + "}" in r.path
        ]
        if r.query is not None:
            params += _query_params(r.query)
        responses: dict[str, Any] = {}
        ok: dict[str, Any] = {"description": "OK" if r.status == 200 else "created"}
        if r.ok is not None:
            ok["content"] = _content(r.ok, refs, "serialization")
        responses[str(r.status)] = ok
        for status in sorted({*r.errors, 401}):
            responses[str(status)] = {"description": ERROR_TEXT[status]}
            if r.method != "head":
                responses[str(status)]["content"] = error
        for status, headers in r.headers.items():
            responses[str(status)]["headers"] = {
                name: {"description": text, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
                for name, text in headers.items()
            }
        op: dict[str, Any] = {
            "operationId": f"{r.method}_{r.path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "summary": r.summary,
            "parameters": params,
            "security": [{r.security: []}],
            "responses": responses,
        }
        if r.body is not None:
            required = r.body in ("binary", "chunk") or any(f.is_required() for f in r.body.model_fields.values())
            op["requestBody"] = {"required": required, "content": _content(r.body, refs, "validation")}
        if r.path.startswith("/worker/"):
            op["tags"] = ["worker"]
        paths.setdefault(r.path, {})[r.method] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aibro backend",
            "version": __version__,
            "description": "Train Keras models on remote machines. Every route takes a bearer token: a user's, or "
            "for /worker/* the per-instance token a worker was started with. Errors are JSON {error, status}.",
        },
        "servers": [{"url": "/api/v1"}],
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "a user's token"},
                "worker": {"type": "http", "scheme": "bearer", "description": "a worker's per-instance token"},
                "enroll": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a cloud instance's one-time enrollment token (from its user data)",
                },
            },
            "schemas": _unrolled_data_tree(defs.get("$defs", {})),
        },
        "paths": paths,
    }


class OpenApiHandler(UserHandler):
    def get(self) -> None:
        self.send(document())
