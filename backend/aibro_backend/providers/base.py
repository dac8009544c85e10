"""The interface every provider offers the scheduler."""

from __future__ import annotations

from typing import Any, Protocol


class CapacityError(RuntimeError):
    """The provider has no room for this machine now (cloud capacity, spot price, quota). A provider whose launches
    finish later reports it through `launch_error(instance_id)`; the scheduler then passes over to the next machine
    in the job's list at once instead of treating the instance as a lost worker."""


class Provider(Protocol):
    name: str

    def offers(self) -> list[dict[str, Any]]:
        """The marketplace: one dict per machine_id this provider can start."""

    def launch(self, instance_id: str, machine_id: str, env: dict[str, str], user_id: int | None = None) -> int | None:
        """Start an instance that runs `aibro worker` with `env` for backend user `user_id` (an instance serves one
        user only, so a provider may confine it per user); return a handle (pid) if any."""

    def alive(self, instance: dict[str, Any]) -> bool:
        """Whether the instance's worker can still be running."""

    def terminate(self, instance: dict[str, Any]) -> None:
        """Make sure the instance is gone."""

    def reap(self) -> None:
        """Release whatever finished instances still hold (exited processes); called on every scheduler tick."""

    # Optional, for providers whose machines take time to start (cloud). The scheduler uses each only if present:
    #   enrolls: bool                              launch gets AIBRO_ENROLL_TOKEN (one-time) instead of a token
    #   poll(instance_id) -> dict | None           {"state": "launching" | "pending" | "running" | ...} (no I/O)
    #   launch_error(instance_id) -> Exception | None   why a launch failed (a CapacityError: pass over)
    #   adopt() -> Future; reconcile(live ids) -> Future    at start-up / every few minutes (see Scheduler)
