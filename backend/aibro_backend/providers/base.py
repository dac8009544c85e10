"""The interface every provider offers the scheduler."""

from __future__ import annotations

from typing import Any, Protocol


class Provider(Protocol):
    name: str

    def offers(self) -> list[dict[str, Any]]:
        """The marketplace: one dict per machine_id this provider can start."""

    def launch(self, instance_id: str, machine_id: str, env: dict[str, str]) -> int | None:
        """Start an instance that runs `aibro worker` with `env`; return a handle (pid) if any."""

    def alive(self, instance: dict[str, Any]) -> bool:
        """Whether the instance's worker can still be running."""

    def terminate(self, instance: dict[str, Any]) -> None:
        """Make sure the instance is gone."""
