"""Before a fit starts: its predicted training time and cost on each machine (issue 38, scheduling/predict.py)."""

from __future__ import annotations

from aibro_core.models import PredictionRequest

from ..scheduling.predict import predict
from .base import ApiError, UserHandler


class PredictionsHandler(UserHandler):
    def post(self) -> None:
        request = self.body_model(PredictionRequest, "the prediction request")
        offers = [offer for _, offer in self.backend.scheduler.machine_index().values()]
        unknown = sorted(set(request.machines or ()) - {o.machine_id for o in offers})
        if unknown:
            raise ApiError(400, f"unknown machine '{unknown[0][:100]}': GET /machines lists the ones offered")
        self.send(predict(self.backend.store, self.uid, offers, request).model_dump(mode="json"))
