"""The base of each process's settings class (the backend's, the kernel's): every field is read from the variable
AIBRO_<FIELD> and validated by pydantic, and every wrong value is reported at once, by the variable's name, its
value and the rule it breaks. An unset or empty variable keeps the field's default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import SettingsError

__all__ = ["EnvSettings", "SettingsError"]

S = TypeVar("S", bound="EnvSettings")
PREFIX = "AIBRO_"


class EnvSettings(BaseSettings):
    """Settings read only through `from_env`, from the mapping it is given (os.environ by default), so a test or a
    caller that hands a worker its environment reads exactly that mapping."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, frozen=True, extra="forbid")
    where: ClassVar[str] = "the backend's environment"  # where a wrong value is fixed, as the error says

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable of `field`."""
        return PREFIX + field.upper()

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str] | None = None) -> S:
        """The settings from `env` (default os.environ); SettingsError names every wrong variable at once."""
        env = os.environ if env is None else env
        raw = {f: env[cls.variable(f)].strip() for f in cls.model_fields if (env.get(cls.variable(f)) or "").strip()}
        try:
            return cls(**raw)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                where = f"{cls.variable(field)}={raw[field]!r}" if field in raw else field
                problems.append(f"{where}: {err['msg'].lower()}")
            raise SettingsError(
                "; ".join(problems) + f" (fix them in {cls.where}, or unset them for the defaults)"
            ) from None
