"""The backend's tornado routes: each path of aibro_core/routes.py to the handler that answers it."""

from __future__ import annotations

import json

import tornado.web

from aibro_core import routes as api_routes

from ..api import predictions, studies, tokens, transfer, user, worker
from ..api.base import BaseHandler
from ..api.openapi import OpenApiHandler
from .state import Backend


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        self.set_status(404)
        self.finish(json.dumps({"error": f"no route {self.request.method} {self.request.path}"}))


HANDLERS: dict[str, type[tornado.web.RequestHandler]] = {
    "/health": user.HealthHandler,
    "/machines": user.MachinesHandler,
    "/policy": user.PolicyHandler,
    "/predictions": predictions.PredictionsHandler,
    "/stats": user.StatsHandler,
    "/auth/tokens": tokens.TokensHandler,
    "/auth/tokens/{token_id}": tokens.TokenHandler,
    "/blobs/uploads/{upload_id}": transfer.UnnamedUploadHandler,
    "/blobs/uploads/{upload_id}/finish": transfer.UnnamedUploadFinish,
    "/blobs/uploads/{upload_id}/upload": transfer.S3UploadHandler,
    "/blobs/{sha256}": transfer.BlobHandler,
    "/jobs": user.JobsHandler,
    "/jobs/{job_id}": user.JobHandler,
    "/jobs/{job_id}/cancel": user.CancelHandler,
    "/jobs/{job_id}/replay": user.ReplayHandler,
    "/jobs/{job_id}/events": user.JobEventsHandler,
    "/events": user.UserEventsHandler,
    "/jobs/{job_id}/artifacts": user.ArtifactsHandler,
    "/jobs/{job_id}/artifacts/{name}": transfer.ArtifactHandler,
    "/studies": studies.StudiesHandler,
    "/studies/{study_id}": studies.StudyHandler,
    "/studies/{study_id}/cancel": studies.StudyCancelHandler,
    "/studies/{study_id}/events": studies.StudyEventsHandler,
    "/instances": user.InstancesHandler,
    "/instances/{instance_id}/terminate": user.TerminateHandler,
    "/openapi.json": OpenApiHandler,
    "/worker/enroll": worker.EnrollHandler,
    "/worker/agent": transfer.AgentHandler,
    "/worker/assignment": worker.AssignmentHandler,
    "/worker/blobs/{sha256}": transfer.WorkerBlobHandler,
    "/worker/envs/{env_key}": transfer.WorkerEnvHandler,
    "/worker/jobs/{job_id}/events": worker.WorkerEventsHandler,
    "/worker/jobs/{job_id}/artifacts/{name}": transfer.WorkerArtifactHandler,
    "/worker/jobs/{job_id}/uploads/{name}": transfer.WorkerUploadHandler,
    "/worker/jobs/{job_id}/finish": worker.WorkerFinishHandler,
}


def routes(backend: Backend) -> list:
    """The tornado routes of aibro_core/routes.py: each path of the table to the handler that answers it."""
    a = {"backend": backend}
    return [(api_routes.pattern(path), HANDLERS[path], a) for path in api_routes.paths()]
