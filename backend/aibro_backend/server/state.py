"""The running backend's parts, handed to every request handler."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..scheduling.policy import Policy
from ..scheduling.scheduler import Scheduler
from ..storage.blobs import BlobStore
from ..storage.bus import EventBus
from ..storage.groupcommit import GroupCommit
from ..storage.store import Store
from .limits import Limits

if TYPE_CHECKING:
    from ..providers.local import LocalProvider
    from ..tuning.studies import StudyDriver


@dataclass
class Backend:
    home: Path
    store: Store
    blobs: BlobStore
    policy: Policy
    bus: EventBus
    scheduler: Scheduler
    local: LocalProvider  # also in scheduler.providers; what only it has (its sandbox, spare, job network)
    limits: Limits  # the request and storage bounds (server/limits.py)
    url: str = ""
    events_port: int | None = None  # the event port (api/eventport.py), announced by /health
    sandbox: str = "none"  # how user code is confined, as GET /health says (composition.check_confinement)
    sandbox_warning: str | None = None  # said on every start and in GET /health when a shared backend runs unconfined
    group_commit: GroupCommit = field(init=False)  # worker batches of one loop turn share a transaction
    study_driver: StudyDriver | None = None  # steps the studies as events come (tuning/studies.py); set by serve

    def __post_init__(self) -> None:
        self.group_commit = GroupCommit(self.store)

    def on_event(self, event: dict[str, Any]) -> None:
        self.bus.publish(event)
