"""The v1 API's routes, once. The backend's handlers (server/routes.py), its OpenAPI document (api/openapi.py),
its event port (api/eventport.py) and the Jupyter server extension's proxy (aibro_jupyter/server/handlers.py) all
derive theirs from this table; a route added here and not there fails their tests, not a user."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

PREFIX = "/api/v1"
# what each path parameter captures; the handlers validate the value and say what is wrong with it
CAPTURES = {
    "job_id": r"[\w-]+",
    "instance_id": r"[\w-]+",
    "study_id": r"[\w-]+",
    "token_id": r"[\w-]+",
    "upload_id": r"[^/]+",
    "sha256": r"[^/]+",
    "name": r".+",
    "env_key": r"[^/]+",
}
BROWSER_CAPTURES = {
    **CAPTURES,
    "job_id": r"[\w-]{1,100}",
    "instance_id": r"[\w-]{1,100}",
    "study_id": r"[\w-]{1,100}",
}  # the proxy's bound


@dataclass(frozen=True)
class Endpoint:
    method: Literal["get", "head", "post", "put", "delete"]
    path: str  # below PREFIX, with {param} for each path parameter
    summary: str
    who: Literal["user", "worker", "enroll"] = "user"  # whose token it takes
    browser: bool = False  # the Jupyter server extension passes it on for the browser (reads, plus cancel)

    @property
    def events(self) -> bool:
        """An event route: takes ?after= and ?wait= and long-polls (the event port answers it too)."""
        return self.method == "get" and self.who == "user" and self.path.endswith("events")


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("get", "/health", "who the token belongs to and the backend version", browser=True),
    Endpoint("get", "/machines", "the marketplace: every machine this backend can start", browser=True),
    Endpoint("get", "/policy", "per-user limits", browser=True),
    Endpoint(
        "post",
        "/predictions",
        "a fit's predicted training time and cost on each machine, from earlier jobs of its model or its FLOPs",
    ),
    Endpoint("get", "/stats", "per-user counters (bytes received, ...)"),
    Endpoint("get", "/auth/tokens", "the caller's live tokens (ids and times, never a secret)"),
    Endpoint("post", "/auth/tokens", "a new token for the calling user"),
    Endpoint("delete", "/auth/tokens/{token_id}", "revoke one of the caller's tokens"),
    Endpoint(
        "head",
        "/blobs/uploads/{upload_id}",
        "X-Received: the bytes of this unnamed upload already here (a resumed upload starts there)",
    ),
    Endpoint(
        "put",
        "/blobs/uploads/{upload_id}",
        "one chunk of a one-pass upload (the client hashes nothing; the backend names the blob at the finish)",
    ),
    Endpoint("delete", "/blobs/uploads/{upload_id}", "drop this user's unfinished unnamed upload (frees its quota)"),
    Endpoint(
        "post",
        "/blobs/uploads/{upload_id}/finish",
        "a complete unnamed upload becomes the blob named by the backend's digest (equal to sha256 when given)",
    ),
    Endpoint(
        "post",
        "/blobs/uploads/{upload_id}/upload",
        "S3 backing: presigned PUT URL(s) for an upload (start), then the user's blob of the sha256 sent (finish)",
    ),
    Endpoint(
        "head",
        "/blobs/{sha256}",
        "200 (X-Blob-Size) if this user holds the blob, else 404 with X-Received: the bytes a resumed upload skips",
    ),
    Endpoint(
        "put",
        "/blobs/{sha256}",
        "one chunk of a content-addressed, resumable upload at ?offset= of a blob of ?total= bytes",
    ),
    Endpoint(
        "delete",
        "/blobs/{sha256}",
        "drop this user's unfinished upload of the blob (frees its quota); a complete blob stays",
    ),
    Endpoint("get", "/jobs", "the user's jobs, and the event cursor to follow from", browser=True),
    Endpoint("post", "/jobs", "submit a job spec"),
    Endpoint("get", "/jobs/{job_id}", "one job: status, substatus, progress, timeline", browser=True),
    Endpoint("post", "/jobs/{job_id}/cancel", "cancel a job; the worker stops within about one batch", browser=True),
    Endpoint(
        "post",
        "/jobs/{job_id}/replay",
        "run a recorded job again, optionally on other machines or with another description",
    ),
    Endpoint(
        "get",
        "/jobs/{job_id}/events",
        "the job's event log after ?after=SEQ, long-polling up to ?wait=S when there is none yet",
        browser=True,
    ),
    Endpoint(
        "get",
        "/events",
        "all of the user's events after the cursor ?after=GID, long-polling up to ?wait=S",
        browser=True,
    ),
    Endpoint("get", "/jobs/{job_id}/artifacts", "the job's artifacts", browser=True),
    Endpoint("get", "/jobs/{job_id}/artifacts/{name}", "download one artifact"),
    Endpoint("get", "/studies", "the user's hyperparameter studies, each with its trials", browser=True),
    Endpoint("post", "/studies", "start a hyperparameter study: each trial the oracle hands out runs as a job"),
    Endpoint("get", "/studies/{study_id}", "one study: its state, trials (each a job) and best trial", browser=True),
    Endpoint("post", "/studies/{study_id}/cancel", "cancel a study and its running trials' jobs", browser=True),
    Endpoint(
        "get",
        "/studies/{study_id}/events",
        "the study's own event log (trials started and ended, its end) after ?after=SEQ, long-polling up to ?wait=S",
        browser=True,
    ),
    Endpoint("get", "/instances", "the user's instances with their state history", browser=True),
    Endpoint("post", "/instances/{instance_id}/terminate", "terminate a cooling or stopped instance now", browser=True),
    Endpoint("get", "/openapi.json", "this document"),
    Endpoint(
        "post",
        "/worker/enroll",
        "exchange the one-time enrollment token (bearer or body) for this instance's worker token, answered once",
        who="enroll",
    ),
    Endpoint(
        "get",
        "/worker/agent",
        "the worker agent wheel this backend builds of itself, for the first boot of a machine it started "
        "(X-Agent-Version, X-Agent-Sha256); its enrollment or worker token",
        who="enroll",
    ),
    Endpoint("get", "/worker/assignment", "what this instance does next", who="worker"),
    Endpoint("get", "/worker/blobs/{sha256}", "a blob of the job assigned to this instance", who="worker"),
    Endpoint(
        "get",
        "/worker/envs/{env_key}",
        "a requirements environment another machine of this instance's user built (a zip of its site-packages)",
        who="worker",
    ),
    Endpoint(
        "post",
        "/worker/jobs/{job_id}/events",
        "the worker's numbered events; a refused batch names the bad event's wseq",
        who="worker",
    ),
    Endpoint(
        "get",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "an artifact of the assigned job (a checkpoint to resume from)",
        who="worker",
    ),
    Endpoint(
        "head",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "how much of an unfinished artifact upload is here (X-Received), to resume it",
        who="worker",
    ),
    Endpoint(
        "put",
        "/worker/jobs/{job_id}/artifacts/{name}",
        "upload an artifact of the assigned job, whole or in chunks (?attempt=&offset=&total=)",
        who="worker",
    ),
    Endpoint(
        "post",
        "/worker/jobs/{job_id}/uploads/{name}",
        "S3 backing: presigned PUT URL(s) for an artifact of the assigned job (start), then index it (finish)",
        who="worker",
    ),
    Endpoint("post", "/worker/jobs/{job_id}/finish", "the attempt's outcome", who="worker"),
)


def paths() -> list[str]:
    """Each path once, in the table's order: a router tries them in turn, and no path of the table matches
    another's concrete form (the handlers are found by fullmatch)."""
    return list(dict.fromkeys(e.path for e in ENDPOINTS))


def pattern(path: str, captures: dict[str, str] = CAPTURES, prefix: str = PREFIX) -> str:
    """The regular expression of a path, one group per parameter, for tornado or `re.fullmatch`."""
    out = re.escape(prefix + path)
    for name in re.findall(r"\{(\w+)\}", path):
        out = out.replace(re.escape("{" + name + "}"), f"({captures[name]})")
    return out
