"""Cancel and Detach, as every panel that follows backend work (a job, a study) offers them: Cancel asks the
backend once, Detach stops the panel following while the work goes on; either can be clicked from the browser
while the cell waits on the kernel's loop."""

from __future__ import annotations

import threading
from collections.abc import Callable

import ipywidgets as w


class FollowControls:
    """The buttons and what a click sets; a panel renders its own state line in `_render_state`."""

    def _make_controls(self) -> None:
        self.canceled = threading.Event()
        self.detached = threading.Event()
        self.cell_state = "running"
        self._on_cancel: Callable[[], None] | None = None
        self.cancel_button = w.Button(description="Cancel", button_style="danger", icon="stop")
        self.detach_button = w.Button(description="Detach", icon="unlink")
        self.cancel_button.on_click(lambda _b: self._cancel())
        self.detach_button.on_click(lambda _b: self.detach())

    def on_cancel(self, fn: Callable[[], None]) -> None:
        self._on_cancel = fn

    def _cancel(self) -> None:
        self.canceled.set()
        self.cancel_button.disabled = True
        if self._on_cancel:
            self._on_cancel()

    def detach(self) -> None:
        """The user detached (Detach or Ctrl-C): the work goes on with the backend, the panel stops following it and
        says so."""
        self.detached.set()
        self.cell_state = "detached"
        self.cancel_button.disabled = True
        self.detach_button.disabled = True
        self._render_state()

    def hide_controls(self) -> None:
        """The work ended: nothing is left to cancel or detach from."""
        for button in (self.cancel_button, self.detach_button):
            button.disabled = True
            button.layout.display = "none"

    def _render_state(self) -> None:
        raise NotImplementedError
