"""The user's hyperparameter studies (issue 27): submit one, list them, see one with its trials, cancel one, follow
one's events (issue 40)."""

from __future__ import annotations

from aibro_core.models import StudySpec

from ..storage.records import StudyRecord
from ..tuning import studies
from . import longpoll
from .base import ApiError, UserHandler
from .user import check_job, query_after_wait


class StudiesHandler(UserHandler):
    def get(self) -> None:
        found = self.backend.store.studies.list(self.uid)
        self.send({"studies": [studies.study_view(self.backend, s).model_dump(mode="json") for s in found]})

    def post(self) -> None:
        raw = self.body_json()
        spec = self.body_model(StudySpec, "the study spec", raw)
        check_job(self.backend, self.uid, self.user["name"], raw["job"])  # what each trial's job will pass
        study_id = studies.create_study(self.backend, self.uid, raw, spec)
        self.send(studies.study_view(self.backend, own_study(self, study_id)).model_dump(mode="json"), 201)


class StudyHandler(UserHandler):
    def get(self, study_id: str) -> None:
        self.send(studies.study_view(self.backend, own_study(self, study_id)).model_dump(mode="json"))


class StudyCancelHandler(UserHandler):
    def post(self, study_id: str) -> None:
        studies.cancel_study(self.backend, own_study(self, study_id))
        self.send(studies.study_view(self.backend, own_study(self, study_id)).model_dump(mode="json"))


class StudyEventsHandler(UserHandler):
    async def get(self, study_id: str) -> None:
        after, wait = query_after_wait(self)
        self.finish(await longpoll.study_events(self.backend, self.uid, study_id, after, wait))


def own_study(handler: UserHandler, study_id: str) -> StudyRecord:
    study = handler.backend.store.studies.get(study_id, handler.uid)
    if study is None:
        raise ApiError(404, f"no study '{study_id[:80]}' for this user: GET /studies lists yours")
    return study
