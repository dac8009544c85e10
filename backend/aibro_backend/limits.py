"""Resource bounds of the service itself (connections, bodies, timeouts, uploads, stored blobs, tokens): what one
client, with or without a token, can hold of the backend. Each has an AIBRO_* override for a shared backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .policy import Policy

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    # Open connections at once (long-polls, workers, uploads); the next one is answered 503 and closed. Also kept
    # below the process's descriptor limit (see app.connection_cap), so accept() never meets EMFILE from sockets.
    # A team's backend holds a long-poll per kernel, sidebar and script watching, plus workers and uploads: 4096
    # leaves room for a thousand watchers (benchmarks/bench_load.py) at about 10 kB of memory each.
    max_connections: int = 4096
    # A connection may wait this long for a request's headers (slow or idle clients, keep-alive included), and an
    # answer its client does not take (stops reading) may sit unsent this long before the connection is dropped.
    idle_timeout_s: float = 60.0
    # A request body must arrive within this, plus 1 s per `min_body_rate` bytes it declares (a 64 MiB chunk gets
    # 30 s + 256 s); a refused body that is read and dropped (app._Guard), so the client reads the answer, gets
    # `linger_s` plus the same 1 s per `min_body_rate` bytes.
    body_timeout_s: float = 30.0
    min_body_rate: int = 256 * 1024
    linger_s: float = 5.0
    # Bodies: JSON routes 1 MiB (a job spec is a few kB), worker event batches 16 MiB (500 events of up to 4 kB
    # text each, escaped), one chunk of a streamed blob or artifact upload 64 MiB (clients send 8 MiB).
    json_max_body: int = 1 * MiB
    events_max_body: int = 16 * MiB
    chunk_max_body: int = 64 * MiB
    # Unfinished uploads a user may hold at once: bytes received (0: twice the per-job data limit; what an upload
    # declares as its total takes no disk until it arrives) and uploads (each a file the quota check reads), and
    # how long one may sit untouched before the sweep deletes it.
    max_partial_bytes: int = 0
    max_partial_uploads: int = 64
    partial_ttl_s: float = 24 * 3600.0
    # Bytes of finished blobs a user holds (0: ten times the per-job data limit). A new blob makes room by dropping
    # the user's least recently used ones that no active job reads (clients upload a blob again when they find
    # it gone); when those jobs' blobs leave no room, the upload is refused.
    max_stored_bytes: int = 0
    # Live (unexpired) tokens per user; minting more is refused until one is revoked or expires.
    max_tokens_per_user: int = 20

    @classmethod
    def from_env(cls, policy: Policy) -> Limits:
        def num(name: str, default: float, kind: type = int) -> float:
            raw = os.environ.get(name)
            return kind(raw) if raw else default

        partial = int(num("AIBRO_MAX_PARTIAL_BYTES", cls.max_partial_bytes))
        stored = int(num("AIBRO_MAX_STORED_BYTES", cls.max_stored_bytes))
        return cls(
            max_connections=int(num("AIBRO_MAX_CONNECTIONS", cls.max_connections)),
            idle_timeout_s=float(num("AIBRO_IDLE_TIMEOUT_S", cls.idle_timeout_s, float)),
            body_timeout_s=float(num("AIBRO_BODY_TIMEOUT_S", cls.body_timeout_s, float)),
            max_partial_bytes=partial or 2 * policy.max_job_bytes,
            max_partial_uploads=int(num("AIBRO_MAX_PARTIAL_UPLOADS", cls.max_partial_uploads)),
            max_stored_bytes=stored or 10 * policy.max_job_bytes,
            partial_ttl_s=float(num("AIBRO_PARTIAL_TTL_S", cls.partial_ttl_s, float)),
            max_tokens_per_user=int(num("AIBRO_MAX_TOKENS_PER_USER", cls.max_tokens_per_user)),
        )


def limits_of(backend: object) -> Limits:
    """The running backend's limits (app.build_backend puts them in `backend.extra`)."""
    extra = getattr(backend, "extra", {})
    if "limits" not in extra:
        extra["limits"] = Limits.from_env(backend.policy)  # type: ignore[attr-defined]
    return extra["limits"]
