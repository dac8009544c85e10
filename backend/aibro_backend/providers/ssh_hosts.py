"""The SSH provider's hosts file: the user's own machines, each checked before the backend listens.

TOML, one table per host::

    [[host]]
    name = "lab1"                         # the machine ids are ssh:lab1 (and ssh:lab1-gpuN with GPUs)
    host = "10.0.0.5"
    port = 22                             # optional, default 22
    user = "alice"
    identity_file = "~/.ssh/id_ed25519"   # a private key without a passphrase, authorized on the host
    max_jobs = 2                          # optional, default 1: jobs at once on this host
    gpus = 1                              # optional: found with nvidia-smi when left out

`load_hosts(path)` names every problem of the file at once (a key file that is missing or is not a private key
included); `SshProvider.check()` then logs in to each host and names the ones it cannot reach.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

NAME_RULE = r"^[a-z0-9][a-z0-9-]{0,30}$"


class HostsError(ValueError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"SSH hosts file {source} has {len(problems)} problem(s):\n{lines}")


class Host(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(pattern=NAME_RULE)]
    host: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\[\]_-]+$")]
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")]
    identity_file: str
    max_jobs: Annotated[int, Field(ge=1, le=64)] = 1
    gpus: Annotated[int, Field(ge=0, le=64)] | None = None

    @field_validator("identity_file")
    @classmethod
    def _key(cls, value: str) -> str:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"the identity file {path} does not exist")
        check = subprocess.run(["ssh-keygen", "-y", "-P", "", "-f", str(path)], capture_output=True, text=True)
        if check.returncode != 0:
            why = (check.stderr.strip() or "not readable as a key")[:200]
            raise ValueError(f"the identity file {path} is not a private key without a passphrase ({why})")
        return str(path)


class Hosts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: list[Host] = Field(min_length=1)

    @field_validator("host")
    @classmethod
    def _unique(cls, hosts: list[Host]) -> list[Host]:
        names = [h.name for h in hosts]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"host names must differ: {', '.join(twice)} appear more than once")
        return hosts


def load_hosts(path: str | Path) -> list[Host]:
    source = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise HostsError(source, [f"cannot read it: {exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise HostsError(source, [f"not valid TOML: {exc}"]) from None
    try:
        return list(Hosts.model_validate(raw).host)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message}")
        raise HostsError(source, problems) from None
