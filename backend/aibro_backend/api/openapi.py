"""The OpenAPI 3.1 document of the v1 API, generated from `aibro_core/models.py`; served at /api/v1/openapi.json.

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

from aibro_core import models as m
from aibro_core import routes

from .base import UserHandler

REF = "#/components/schemas/{model}"
COUNT = {"type": "string", "pattern": "^[0-9]+$"}
HEADER_SCHEMAS = {
    "X-Received": COUNT,
    "X-Blob-Size": COUNT,
    "X-Chunk-Max": COUNT,
    "X-Upload-Via": {"type": "string", "enum": ["s3"]},
}
SECURITY = {"user": "bearer", "worker": "worker", "enroll": "enroll"}  # who -> the scheme that names it
ERROR_TEXT = {
    400: "the request is malformed: the message names the field and the fix",
    401: "no token, or one this backend does not know",
    403: "the token may not reach this resource",
    404: "no such resource for this token",
    409: "the request conflicts with the resource's state",
    411: "an upload without Content-Length",
    413: "over a size limit (per job, per chunk or per body)",
    429: "over a per-user limit (active jobs, tokens, uploads): the message says which and how to free one",
    503: "the backend's S3 bucket is not answering now: try again in a moment",
    507: "the backend could not store the upload",
}
PATH_PARAMS: dict[str, dict[str, Any]] = {
    "sha256": {"type": "string", "pattern": m.SHA_PATTERN, "description": "a blob's sha256 hex digest"},
    "job_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "a job id, e.g. job-20250101-1a2b3c4d"},
    "study_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "a study id, e.g. study-20250101-1a2b3c4d"},
    "instance_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "an instance id"},
    "upload_id": {"type": "string", "pattern": m.UPLOAD_ID_PATTERN, "description": "an unnamed upload's id"},
    "token_id": {"type": "string", "pattern": m.ID_PATTERN, "description": "a token's public id"},
    "name": {"type": "string", "pattern": m.ARTIFACT_NAME_PATTERN, "description": "an artifact name"},
    "env_key": {"type": "string", "pattern": m.ENV_KEY_PATTERN, "description": "a requirements environment's key"},
}


@dataclass
class Answer:
    """What one route of aibro_core/routes.py takes and answers, for the document."""

    ok: type[BaseModel] | str | None  # a model, "binary" (octet-stream), or None (no body, e.g. HEAD)
    errors: tuple[int, ...] = ()
    body: type[BaseModel] | str | None = None  # a model, "binary", or "chunk" (octet-stream of at least one byte)
    query: type[BaseModel] | None = None
    status: int = 200
    headers: dict[int, dict[str, str]] = field(default_factory=dict)


TRANSFER_ERRORS = (400, 403, 404, 409, 411, 413, 429, 507)
S3_ERRORS = (400, 409, 413, 503, 507)  # an upload to S3 (start, finish): S3 failing for now, or for good
# keyed "method path" as in aibro_core/routes.py; an endpoint without its answer here fails at import
ANSWERS: dict[str, Answer] = {
    "get /health": Answer(m.Health),
    "get /machines": Answer(m.Machines),
    "get /policy": Answer(m.Policy),
    "post /predictions": Answer(m.Predictions, (400,), m.PredictionRequest),
    "get /stats": Answer(m.Stats),
    "get /auth/tokens": Answer(m.Tokens),
    "post /auth/tokens": Answer(m.TokenMinted, (400, 429), m.TokenMint, None, 201),
    "delete /auth/tokens/{token_id}": Answer(m.TokenRevoked, (404,)),
    "head /blobs/{sha256}": Answer(
        None,
        (400, 404),
        headers={
            200: {"X-Blob-Size": "the blob's size"},
            404: {
                "X-Received": "bytes of a partial upload",
                "X-Chunk-Max": "the most bytes one PUT may carry",
                "X-Upload-Via": "'s3' when this backend keeps bytes in S3: POST /blobs/uploads/{id}/upload instead",
            },
        },
    ),
    "put /blobs/{sha256}": Answer(m.BlobProgress, TRANSFER_ERRORS, "binary", m.BlobQuery),
    "delete /blobs/{sha256}": Answer(m.BlobDropped, (400, 409)),
    "head /blobs/uploads/{upload_id}": Answer(
        None,
        (400,),
        headers={
            200: {
                "X-Received": "bytes received",
                "X-Chunk-Max": "the most bytes one PUT may carry",
                "X-Upload-Via": "'s3' when uploads go to S3 instead",
            }
        },
    ),
    "put /blobs/uploads/{upload_id}": Answer(m.BlobProgress, TRANSFER_ERRORS, "chunk", m.BlobQuery),
    "delete /blobs/uploads/{upload_id}": Answer(m.BlobDropped, (400, 409)),
    "post /blobs/uploads/{upload_id}/finish": Answer(m.BlobNamed, (400, 409, 413), m.NameUpload),
    "post /blobs/uploads/{upload_id}/upload": Answer(m.UploadPlan, S3_ERRORS, m.S3Upload),
    "get /jobs": Answer(m.Jobs),
    "post /jobs": Answer(m.Job, (400, 413, 429), m.JobSpec, None, 201),
    "get /jobs/{job_id}": Answer(m.Job, (404,)),
    "post /jobs/{job_id}/cancel": Answer(m.Job, (404,)),
    "post /jobs/{job_id}/replay": Answer(m.Job, (400, 404, 409, 413, 429), m.ReplayOverrides, None, 201),
    "get /jobs/{job_id}/events": Answer(m.JobEvents, (400, 404), None, m.EventsQuery),
    "get /events": Answer(m.UserEvents, (400,), None, m.EventsQuery),
    "get /jobs/{job_id}/artifacts": Answer(m.Artifacts, (404,)),
    "get /jobs/{job_id}/artifacts/{name}": Answer("binary", (400, 404)),
    "get /studies": Answer(m.Studies),
    "post /studies": Answer(m.Study, (400, 413, 429), m.StudySpec, None, 201),
    "get /studies/{study_id}": Answer(m.Study, (404,)),
    "post /studies/{study_id}/cancel": Answer(m.Study, (404,)),
    "get /studies/{study_id}/events": Answer(m.StudyEvents, (400, 404), None, m.EventsQuery),
    "get /instances": Answer(m.Instances),
    "post /instances/{instance_id}/terminate": Answer(m.InstanceAnswer, (404, 409)),
    "get /openapi.json": Answer(m.OpenApiDocument),
    "post /worker/enroll": Answer(m.WorkerEnrolled, (400,), m.WorkerEnroll),
    "get /worker/agent": Answer(
        "binary",
        (),
        headers={200: {"X-Agent-Version": "the agent's version", "X-Agent-Sha256": "the wheel's SHA-256 (hex)"}},
    ),
    "get /worker/assignment": Answer(m.Assignment, ()),
    "get /worker/blobs/{sha256}": Answer("binary", (403, 404)),
    "get /worker/envs/{env_key}": Answer("binary", (400, 404)),
    "post /worker/jobs/{job_id}/events": Answer(m.EventsAck, (400, 409), m.WorkerEvents),
    "get /worker/jobs/{job_id}/artifacts/{name}": Answer("binary", (400, 404, 409)),
    "head /worker/jobs/{job_id}/artifacts/{name}": Answer(
        None, (400, 409), None, m.AttemptQuery, headers={200: {"X-Received": "bytes of the unfinished upload"}}
    ),
    "put /worker/jobs/{job_id}/artifacts/{name}": Answer(
        m.ArtifactStored, TRANSFER_ERRORS, "binary", m.ArtifactChunkQuery
    ),
    "post /worker/jobs/{job_id}/uploads/{name}": Answer(m.UploadPlan, S3_ERRORS, m.S3Upload),
    "post /worker/jobs/{job_id}/finish": Answer(m.Ok, (400, 409), m.WorkerFinish),
}

EXTRA_SCHEMAS: tuple[type[BaseModel], ...] = ()
_unanswered = {f"{e.method} {e.path}" for e in routes.ENDPOINTS} ^ set(ANSWERS)
if _unanswered:
    raise RuntimeError(f"routes without a documented answer, or answers without a route: {sorted(_unanswered)}")


def _models() -> list[tuple[type[BaseModel], str]]:
    found: list[tuple[type[BaseModel], str]] = [(m.ErrorBody, "serialization")]
    for r in ANSWERS.values():
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
    for e in routes.ENDPOINTS:
        r = ANSWERS[f"{e.method} {e.path}"]
        params = [
            {"name": name, "in": "path", "required": True, "schema": schema}
            for name, schema in PATH_PARAMS.items()
            if "{" + name + "}" in e.path
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
            if e.method != "head":
                responses[str(status)]["content"] = error
        for status, headers in r.headers.items():
            responses[str(status)]["headers"] = {
                name: {"description": text, "schema": HEADER_SCHEMAS.get(name, {"type": "string"})}
                for name, text in headers.items()
            }
        op: dict[str, Any] = {
            "operationId": f"{e.method}_{e.path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "summary": e.summary,
            "parameters": params,
            "security": [{SECURITY[e.who]: []}],
            "responses": responses,
        }
        if r.body is not None:
            required = r.body in ("binary", "chunk") or any(f.is_required() for f in r.body.model_fields.values())
            op["requestBody"] = {"required": required, "content": _content(r.body, refs, "validation")}
        if e.path.startswith("/worker/"):
            op["tags"] = ["worker"]
        paths.setdefault(e.path, {})[e.method] = op
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
