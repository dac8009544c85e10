"""Resource bounds of the service itself (connections, bodies, timeouts, uploads, stored blobs, tokens): what one
client, with or without a token, can hold of the backend. Each has an AIBRO_* override for a shared backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated

from pydantic import Field

from aibro_core.envsettings import read_env

from ..scheduling.policy import Policy

MiB = 1024 * 1024
Size = Annotated[int, Field(ge=0)]  # 0 where a field says "0: derived from the policy"
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
ENV = {
    "max_connections": "AIBRO_MAX_CONNECTIONS",
    "idle_timeout_s": "AIBRO_IDLE_TIMEOUT_S",
    "body_timeout_s": "AIBRO_BODY_TIMEOUT_S",
    "max_partial_bytes": "AIBRO_MAX_PARTIAL_BYTES",
    "max_partial_uploads": "AIBRO_MAX_PARTIAL_UPLOADS",
    "max_stored_bytes": "AIBRO_MAX_STORED_BYTES",
    "partial_ttl_s": "AIBRO_PARTIAL_TTL_S",
    "max_tokens_per_user": "AIBRO_MAX_TOKENS_PER_USER",
    "chunk_max_body": "AIBRO_CHUNK_MAX_BODY",
}


@dataclass(frozen=True)
class Limits:
    # Open connections at once (long-polls, workers, uploads); the next one is answered 503 and closed. Also kept
    # below the process's descriptor limit (see listener.connection_cap), so accept() never meets EMFILE from sockets.
    # A team's backend holds a long-poll per kernel, sidebar and script watching, plus workers and uploads: 4096
    # leaves room for a thousand watchers (benchmarks/bench_load.py) at about 10 kB of memory each.
    max_connections: Positive = 4096
    # A connection may wait this long for a request's headers (slow or idle clients, keep-alive included), and an
    # answer its client does not take (stops reading) may sit unsent this long before the connection is dropped.
    idle_timeout_s: Seconds = 60.0
    # A request body must arrive within this, plus 1 s per `min_body_rate` bytes it declares (a 64 MiB chunk gets
    # 30 s + 256 s); a refused body that is read and dropped (app._Guard), so the client reads the answer, gets
    # `linger_s` plus the same 1 s per `min_body_rate` bytes.
    body_timeout_s: Seconds = 30.0
    min_body_rate: int = 256 * 1024
    linger_s: float = 5.0
    # Bodies: JSON routes 1 MiB (a job spec is a few kB), worker event batches 16 MiB (500 events of up to 4 kB
    # text each, escaped), one chunk of a streamed blob or artifact upload 64 MiB (clients send 8 MiB from a file,
    # 64 MiB from an array's buffer, never more than HEAD's X-Chunk-Max: lower it, to 8 MiB at least (a worker's
    # artifact chunk), behind a proxy that caps bodies).
    json_max_body: int = 1 * MiB
    events_max_body: int = 16 * MiB
    chunk_max_body: Annotated[int, Field(ge=8 * MiB)] = 64 * MiB
    # Unfinished uploads a user may hold at once: bytes received (0: twice the per-job data limit; what an upload
    # declares as its total takes no disk until it arrives) and uploads (each a file the quota check reads), and
    # how long one may sit untouched before the sweep deletes it.
    max_partial_bytes: Size = 0
    max_partial_uploads: Positive = 64
    partial_ttl_s: Seconds = 24 * 3600.0
    # Bytes of finished blobs a user holds (0: ten times the per-job data limit). A new blob makes room by dropping
    # the user's least recently used ones that no active job reads (clients upload a blob again when they find
    # it gone); when those jobs' blobs leave no room, the upload is refused.
    max_stored_bytes: Size = 0
    # Live (unexpired) tokens per user; minting more is refused until one is revoked or expires.
    max_tokens_per_user: Positive = 20

    @classmethod
    def from_env(cls, policy: Policy, env: Mapping[str, str] | None = None) -> Limits:
        """The limits from AIBRO_* variables (ENV); SettingsError names every wrong one at once."""
        limits = read_env(cls, ENV, os.environ if env is None else env)
        return replace(
            limits,
            max_partial_bytes=limits.max_partial_bytes or 2 * policy.max_job_bytes,
            max_stored_bytes=limits.max_stored_bytes or 10 * policy.max_job_bytes,
        )


def limits_of(backend: object) -> Limits:
    """The running backend's limits (composition.build_backend puts them in `backend.extra`)."""
    extra = getattr(backend, "extra", {})
    if "limits" not in extra:
        extra["limits"] = Limits.from_env(backend.policy)  # type: ignore[attr-defined]
    return extra["limits"]
