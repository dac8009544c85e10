"""Every operation the scheduler asks of a provider, declared once: what it means, when it is called, and what a
provider that has nothing to say returns (the default). A new provider subclasses `Provider`, implements the four
abstract operations, and overrides only the optional ones its machines need; the scheduler calls each of them
directly and never asks a provider what it has.

Instances reach a provider as the store's rows (`storage/records.InstanceRecord`). Operations
that talk to a cloud return a Future and must not block the scheduler's tick."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..storage.records import InstanceRecord

if TYPE_CHECKING:  # a Ray node imports the providers' modules with the standard library only (ray_actor.py)
    from aibro_core.models import Machine


class CapacityError(RuntimeError):
    """The provider has no room for this machine now (cloud capacity, spot price, quota). A provider whose launches
    finish later reports it through `launch_error(instance_id)`; the scheduler then passes over to the next machine
    in the job's list at once instead of treating the instance as a lost worker."""


@dataclass(frozen=True)
class LaunchRequest:
    """One instance the scheduler asks a provider to start, for one attempt of one job."""

    instance_id: str
    machine_id: str
    env: Mapping[str, str]
    """What the worker agent runs with (its backend URL, instance id, worker or enrollment token)."""
    user_id: int | None = None
    """The backend user it serves: an instance serves one user only, so a provider may confine it per user."""
    job_id: str | None = None
    """The job it starts for (a cloud tags its machine with it)."""
    attempt: int = 0
    """That job's attempt (a cloud's launch idempotency token differs per attempt)."""
    tensorflow: str | None = None
    """The job's kernel's TensorFlow (major.minor), which a provider that installs the agent on a machine with no
    TensorFlow installs (shipping.install_script)."""


MachineState = Literal[
    "launching",  # the request is in flight
    "pending",
    "running",
    "stopping",
    "stopped",
    "shutting-down",
    "terminated",
    "failed",  # the launch failed (`launch_error` says why)
    "unknown",  # left by an earlier backend, not listed yet
]
"""A machine's state as its provider last saw it: a cloud's own states, plus the request before it has one."""


@dataclass(frozen=True)
class PollResult:
    """What a provider last saw of one machine (`poll`)."""

    state: MachineState
    error: str | None = None
    capacity_error: bool = False  # the launch failed for want of room (a CapacityError)


class Provider(ABC):
    """Where machines come from. Class attributes declare what the provider can do."""

    name: ClassVar[str]
    enrolls: bool = False
    """Launches get a one-time AIBRO_ENROLL_TOKEN (a machine that reads its own launch data) instead of a worker
    token; the worker exchanges it for its token (POST /worker/enroll)."""
    can_stop: bool = False
    """On-demand machines can be stopped instead of terminated and started again for a later job (`stop`, `start`,
    `poll`)."""

    # -- required --------------------------------------------------------------------------------------------
    @abstractmethod
    def offers(self) -> list[Machine]:
        """The marketplace: one Machine per machine_id this provider can start (what GET /machines lists)."""

    @abstractmethod
    def launch(self, request: LaunchRequest) -> int | None:
        """Start an instance that runs the worker agent as `request` says (LaunchRequest). Return a handle (a pid)
        if there is one. Raising fails this machine and the job moves on to the next in its list."""

    @abstractmethod
    def alive(self, instance: InstanceRecord) -> bool:
        """Whether the instance's worker can still be running (no I/O: called for every instance on every tick)."""

    @abstractmethod
    def terminate(self, instance: InstanceRecord) -> Future | None:
        """Make sure the instance is gone for good, and everything its jobs started with it."""

    # -- optional, with what a provider that has nothing to say returns ---------------------------------------
    def reap(self) -> None:
        """Release what finished instances still hold (exited processes, their folders); called on every tick."""
        return None

    def close(self) -> None:
        """The backend stops: release what the provider itself holds (pools, clients, a spare worker)."""
        return None

    def launch_error(self, instance_id: str) -> BaseException | None:
        """Why a launch that finishes later (a cloud's) failed, once it has: a CapacityError passes over to the next
        machine at once; anything else counts as a lost worker."""
        return None

    def poll(self, instance_id: str) -> PollResult | None:
        """What the provider last saw of the machine, without I/O; None if it does not know it."""
        return None

    def pending(self, instance: InstanceRecord) -> str | None:
        """Why a launched instance is not running yet, in words the user sees while the job waits."""
        return None

    def waiting_for(self, machine_id: str) -> str | None:
        """What a job waits for while every `machine_id` is in use (a Ray node's resources, say)."""
        return None

    def cluster_error(self) -> str | None:
        """Why none of this provider's machines can be used now (a Ray cluster that stopped); None when they can."""
        return None

    def lost_reason(self, instance: InstanceRecord) -> str | None:
        """Why a worker that is no longer alive went away, if the provider knows (its node died, say)."""
        return None

    def spare_of(self, user_id: int) -> str | None:
        """The machine id of a spare worker this provider keeps ready for `user_id`'s next job there, or None."""
        return None

    def info(self, instance: InstanceRecord) -> dict[str, Any]:
        """Extra fields the instance's view shows (the Ray node it runs on, say)."""
        return {}

    def adopt(self) -> Future | None:
        """At start-up: find the machines this provider left running (a crash, a restart) and tell the store; None
        for a provider whose machines never outlive the backend."""
        return None

    def reconcile(self, known_instance_ids: Iterable[str]) -> Future | None:
        """Every few minutes: end machines the store does not know as live or stopped, so nothing leaks money."""
        return None

    def stop(self, instance: InstanceRecord) -> Future:
        """Stop (not terminate) an on-demand machine kept for later (only where `can_stop`)."""
        raise NotImplementedError(f"{self.name} machines cannot be stopped")

    def start(self, instance: InstanceRecord) -> Future:
        """Start a stopped machine again for a job (only where `can_stop`)."""
        raise NotImplementedError(f"{self.name} machines cannot be started again")
