"""Every AIBRO_* setting the kernel side reads (the magics, the `aibro` command, the Jupyter server extension), in one
class; the README's settings table is written from it (`python -m aibro_core.settingsdoc`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from aibro_core.envsettings import EnvSettings


class KernelSettings(EnvSettings):
    """The kernel's settings, from AIBRO_<FIELD>."""

    where: ClassVar[str] = "the notebook's environment"

    home: Path = Field(
        default_factory=lambda: Path.home() / ".aibro",
        description="The folder of the login, the embedded backend's files and the kernel's logs.",
    )
    backend_url: str | None = Field(
        None, description="A shared backend to use instead of the embedded one (with AIBRO_TOKEN)."
    )
    token: str | None = Field(None, repr=False, description="The token for AIBRO_BACKEND_URL.")
    ca_bundle: str | None = Field(
        None, description="The PEM file that verifies an HTTPS backend (else the login's, else the system's roots)."
    )
    native_logs: bool = Field(
        False, description="Keep TensorFlow's native start-up lines (absl, cuInit) on the screen, for debugging."
    )
    allow_unsafe: str = Field(
        "all", description="Who the embedded backend lets load models with safe_mode=False (it has one user: all)."
    )
    spare_worker: bool = Field(
        True, description="Whether the embedded backend keeps a spare worker ready for the next first job."
    )
