"""Resource bounds of the service itself (connections, bodies, timeouts, uploads, stored blobs, tokens): what one
client, with or without a token, can hold of the backend. Most have an AIBRO_* override for a shared backend
(settings.py: their bounds and defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from ..scheduling.policy import Policy
from ..settings import DEFAULTS, BackendSettings

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    # Open connections at once (long-polls, workers, uploads); the next one is answered 503 and closed. Also kept
    # below the process's descriptor limit (see listener.connection_cap), so accept() never meets EMFILE from sockets.
    # A team's backend holds a long-poll per kernel, sidebar and script watching, plus workers and uploads: 4096
    # leaves room for a thousand watchers (benchmarks/bench_load.py) at about 10 kB of memory each.
    max_connections: int = DEFAULTS.max_connections
    # A connection may wait this long for a request's headers (slow or idle clients, keep-alive included), and an
    # answer its client does not take (stops reading) may sit unsent this long before the connection is dropped.
    idle_timeout_s: float = DEFAULTS.idle_timeout_s
    # A request body must arrive within this, plus 1 s per `min_body_rate` bytes it declares (a 64 MiB chunk gets
    # 30 s + 256 s); a refused body that is read and dropped (app._Guard), so the client reads the answer, gets
    # `linger_s` plus the same 1 s per `min_body_rate` bytes.
    body_timeout_s: float = DEFAULTS.body_timeout_s
    min_body_rate: int = 256 * 1024
    linger_s: float = 5.0
    # Bodies: JSON routes 1 MiB (a job spec is a few kB), worker event batches 16 MiB (500 events of up to 4 kB
    # text each, escaped), one chunk of a streamed blob or artifact upload 64 MiB (clients send 8 MiB from a file,
    # 64 MiB from an array's buffer, never more than HEAD's X-Chunk-Max: lower it, to 8 MiB at least (a worker's
    # artifact chunk), behind a proxy that caps bodies).
    json_max_body: int = 1 * MiB
    events_max_body: int = 16 * MiB
    chunk_max_body: int = DEFAULTS.chunk_max_body
    # Unfinished uploads a user may hold at once: bytes received (0: twice the per-job data limit; what an upload
    # declares as its total takes no disk until it arrives) and uploads (each a file the quota check reads), and
    # how long one may sit untouched before the sweep deletes it.
    max_partial_bytes: int = DEFAULTS.max_partial_bytes
    max_partial_uploads: int = DEFAULTS.max_partial_uploads
    partial_ttl_s: float = DEFAULTS.partial_ttl_s
    # Bytes of finished blobs a user holds (0: ten times the per-job data limit). A new blob makes room by dropping
    # the user's least recently used ones that no active job reads (clients upload a blob again when they find
    # it gone); when those jobs' blobs leave no room, the upload is refused.
    max_stored_bytes: int = DEFAULTS.max_stored_bytes
    # Live (unexpired) tokens per user; minting more is refused until one is revoked or expires.
    max_tokens_per_user: int = DEFAULTS.max_tokens_per_user

    @classmethod
    def from_env(cls, policy: Policy, env: Mapping[str, str] | None = None) -> Limits:
        """The limits from AIBRO_* variables; SettingsError names every wrong one at once."""
        return cls.of(BackendSettings.from_env(env), policy)

    @classmethod
    def of(cls, settings: BackendSettings, policy: Policy) -> Limits:
        """The limits `settings` set, the ones derived from the policy where they say 0."""
        given = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in BackendSettings.model_fields}
        return cls(
            **{
                **given,
                "max_partial_bytes": settings.max_partial_bytes or 2 * policy.max_job_bytes,
                "max_stored_bytes": settings.max_stored_bytes or 10 * policy.max_job_bytes,
            }
        )
