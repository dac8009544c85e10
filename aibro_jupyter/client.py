"""The one place that speaks HTTP to the backend: REST calls, chunked blob upload, event long-poll."""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aibro_core import vocabulary as v
from aibro_core.backoff import S3_PART, Backoff, retry
from aibro_core.errors import AibroError, ApiError, BackendUnreachable
from aibro_core.models import (
    Artifact,
    Artifacts,
    Health,
    Instance,
    InstanceAnswer,
    Instances,
    Job,
    Jobs,
    JobSpec,
    Machine,
    Machines,
    Policy,
    Prediction,
    PredictionRequest,
    Predictions,
    Stats,
    Study,
    TokenInfo,
    TokenMinted,
    TokenRevoked,
    Tokens,
)
from aibro_core.presigned import S3_RETRY_S, ViewBody, broke_off, upload_via_s3
from aibro_core.transport import (
    EVENT_PORT_CONNECT_S,
    EVENT_PORT_RECHECK_S,
    Transport,
    event_port_url,
    may_have_event_port,
)

from .blobsource import CHUNK, ArraySource, ByteSource, FileSource

if TYPE_CHECKING:
    import requests

    from .config import Target

RETRY_MAX_S = 15.0  # the longest pause between two tries while a configured backend does not answer
FOLLOW_BACKOFF = Backoff(1.0, RETRY_MAX_S)  # between two long-polls of a job's events that found no backend
CHUNK_BACKOFF = Backoff(2.0, 8.0)  # between two tries of an upload chunk to a configured backend
# calls that create something: never sent twice, as the first one may have arrived before the backend died
_NOT_RETRIED = re.compile(r"POST /(jobs|jobs/[^/]+/replay|auth/login|auth/tokens)")


def _notify_stderr(message: str) -> None:
    print(f"aibro: {message}", file=sys.stderr, flush=True)


class _Transport(Transport):
    """The shared transport, plus one recovery (`BackendClient.recover`) before a call reports the backend
    unreachable. `recover=False` on a call skips it (the event follower recovers on its own, with notices)."""

    def __init__(
        self, url: str, token: str, on_unreachable: Callable[[], bool] | None, ca_bundle: str | None = None
    ) -> None:
        super().__init__(url, token, ca_bundle_file=ca_bundle)
        self.on_unreachable = on_unreachable

    def send(self, method: str, path: str, *, recover: bool = True, **kw: Any) -> requests.Response:
        try:
            return super().send(method, path, **kw)
        except BackendUnreachable:
            retry = recover and self.on_unreachable and not _NOT_RETRIED.fullmatch(f"{method} {path}")
            if not retry or not self.on_unreachable():
                raise
        return super().send(method, path, **kw)


def _send_size(source: ByteSource, head: requests.Response) -> int:
    """Bytes per PUT: the source's own (an array's buffer goes in large requests, each a round trip the upload
    waits for), within what the backend says one PUT may carry."""
    announced = head.headers.get("X-Chunk-Max", "")
    return min(source.send_size, int(announced)) if announced.isdigit() and int(announced) > 0 else CHUNK


class BackendClient:
    """What kernels, the CLI and the server extension ask of the backend.

    `restart`, when given (`training.connect()` gives `config.start_embedded` for the embedded backend), brings an
    unreachable backend back: a call that finds it gone restarts it, points this client at its (possibly new) URL
    and tries once more, telling `notify` (stderr by default); `follow` does the same for as long as it takes and
    tells its watchers through local events. Without it an unreachable backend raises, and `follow` retries with
    backoff."""

    def __init__(
        self,
        url: str,
        token: str,
        restart: Callable[[], Target] | None = None,
        notify: Callable[[str], None] | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        """`ca_bundle`: the PEM file that verifies an HTTPS backend (default AIBRO_CA_BUNDLE, else system roots)."""
        self.t = _Transport(url, token, self.recover if restart else None, ca_bundle)
        self._restart = restart
        self.notify = notify or _notify_stderr
        self._event_base: tuple[float, str | None] | None = None  # (when learned, event port URL or None)

    @property
    def url(self) -> str:
        return self.t.url

    # -- when the backend is gone -----------------------------------------------------------------
    def restart(self) -> None:
        """Start the embedded backend again (its own lock makes one start however many clients ask; it reuses
        the last port when free) and point this client at it. Raises BackendUnreachable when it cannot."""
        if self._restart is None:
            raise BackendUnreachable(f"the aibro backend at {self.url} is not one this client can restart")
        target = self._restart()
        self.t.url = target.url.rstrip("/")
        self._event_base = None  # a restarted backend has a new event port
        if target.token != self.t.token:
            self.t.token = target.token
            self.t.session.headers["Authorization"] = f"Bearer {target.token}"

    def recover(self) -> bool:
        """One call found the backend unreachable: restart it, saying so; True when it is back."""
        self.notify("backend unreachable, restarting…")
        try:
            self.restart()
        except BackendUnreachable as exc:
            self.notify(f"could not restart the backend: {exc}")
            return False
        self.notify(f"backend is back at {self.url}")
        return True

    # -- discovery --------------------------------------------------------------------------------
    def health(self) -> Health:
        return Health.model_validate(self.t.json("GET", "/health", timeout=5))

    def machines(self) -> list[Machine]:
        return Machines.model_validate(self.t.json("GET", "/machines")).machines

    def policy(self) -> Policy:
        return Policy.model_validate(self.t.json("GET", "/policy"))

    def predict(self, request: PredictionRequest) -> list[Prediction]:
        """The fit's predicted time and cost on each machine (or each one `request.machines` names)."""
        body = request.model_dump(mode="json", exclude_none=True)
        return Predictions.model_validate(self.t.json("POST", "/predictions", json=body)).predictions

    def counters(self) -> dict[str, int]:
        return Stats.model_validate(self.t.json("GET", "/stats")).counters

    # -- blobs ------------------------------------------------------------------------------------
    def upload_blob(self, path: Path, sha: str | None = None) -> tuple[str, int]:
        """Upload a file content-addressed, resuming a partial upload; returns (sha, bytes sent)."""
        source = FileSource(Path(path))
        return self.upload_source(source, sha or source.sha256())

    def upload_array(self, arr: Any) -> tuple[str, int]:
        """Upload an array (numpy or memmap) from its own buffer as a .npy blob; returns (sha, bytes sent)."""
        return self.upload_source(ArraySource(arr))

    def upload_source(self, source: ByteSource, sha: str | None = None) -> tuple[str, int]:
        """Upload bytes from where they are (an array's buffer, a file), content-addressed; returns (sha, bytes
        sent). Nothing is sent when the backend has them; a partial upload resumes where it stopped.

        Without `sha`, the source decides how (blobsource.py, hashcache.py): a name it knows without hashing is
        used as is (and forgotten if the backend finds other bytes); bytes that are probably new (a large array
        never seen here) go in one pass, unnamed, and the backend names the blob by the digest it computes on the
        way in (`/blobs/uploads/{id}`); anything else is hashed first, so the backend can answer "already here"
        before a byte moves. When the backend keeps bytes in S3 (`X-Upload-Via: s3`), they go there on the
        presigned URLs it answers, hashed on a thread while they go when they had no name."""
        if sha is not None:
            return self._upload_named(source, sha)
        known = source.known_sha()
        if known is not None:
            try:
                return self._upload_named(source, known)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                source.forget()  # the backend hashed other bytes than the name said: go on as for unknown bytes
        done = self._upload_one_pass(source) if source.maybe_new() else None
        if done is None:
            done = self._upload_named(source, source.sha256())
        source.remember(done[0])
        return done

    def _upload_named(self, source: ByteSource, sha: str) -> tuple[str, int]:
        total = source.size
        head = self.t.request("HEAD", f"/blobs/{sha}")
        if head.status_code == 200:
            return sha, 0
        if head.headers.get("X-Upload-Via") == "s3":
            upload_via_s3(self.t, f"/blobs/uploads/{secrets.token_hex(16)}/upload", total, source.view, sha)
            return sha, total
        offset = int(head.headers.get("X-Received", "0"))
        if offset >= total:
            self._put_chunk(f"/blobs/{sha}", memoryview(b""), offset, total)
            return sha, 0
        sent = 0
        for chunk in source.chunks(offset, _send_size(source, head)):
            got = self._put_chunk(f"/blobs/{sha}", chunk, offset, total)
            sent += got - offset
            offset = got
            if got >= total:
                break
        return sha, sent

    def _upload_one_pass(self, source: ByteSource) -> tuple[str, int]:
        """Send the bytes once, unnamed, and let the backend name them by the digest it computes as they arrive; to
        S3, the parts go in parallel while a thread hashes them, and the finish names them by that digest."""
        path = f"/blobs/uploads/{source.upload_id()}"
        head = self.t.request("HEAD", path)
        if head.headers.get("X-Upload-Via") == "s3":  # an S3 upload is not resumed: each try has a key of its own
            upload = f"/blobs/uploads/{secrets.token_hex(16)}/upload"
            named = upload_via_s3(self.t, upload, source.size, source.view, None)
            return named["sha256"], source.size
        total = source.size
        offset = int(head.headers.get("X-Received") or 0)  # what a kernel killed mid-upload sent of the same bytes
        if not 0 <= offset <= total:
            offset = 0
        for chunk in source.chunks(offset, _send_size(source, head)):
            offset = self._put_chunk(path, chunk, offset, total)
        named = self.t.json("POST", f"{path}/finish", json={"size": total})
        return named["sha256"], total

    def _put_chunk(self, path: str, chunk: memoryview, offset: int, total: int) -> int:
        """PUT `chunk` at `offset`, until all of it is stored. After a broken connection or a dead backend (which
        the embedded one is restarted from), ask how much arrived (HEAD X-Received) and send only the rest, with
        a fresh body each time. Returns the offset after the chunk."""
        start, end = offset, offset + len(chunk)
        at, held = offset, False  # held: the backend said it holds the whole chunk
        failed: list[Exception] = []

        def send() -> int:
            nonlocal at
            if held:
                return end
            while True:
                rest = chunk[at - start :]
                body = ViewBody(rest) if len(rest) else b""
                got = self.t.json("PUT", path, params={"offset": at, "total": total}, data=body, recover=False)
                if got.get("complete"):
                    return max(end, int(got.get("received", end)))
                at = int(got["received"])
                if at >= end:
                    return at

        def between_tries(seconds: float) -> None:
            """A dead backend is restarted (the embedded one) or waited for; then the next try starts from what
            arrived."""
            nonlocal at, held
            if isinstance(failed[-1], BackendUnreachable):
                if self._restart is not None:
                    if not self.recover():
                        raise failed[-1]
                else:
                    time.sleep(seconds)
            head = self.t.request("HEAD", path)
            held = "X-Blob-Size" in head.headers  # a named blob the backend now holds
            if held:
                return
            at = int(head.headers.get("X-Received", "0"))
            if not start <= at <= end:
                raise ApiError(409, f"the backend holds {at} bytes of this upload, not {start} to {end}: retry")
            held = at == end

        return retry(
            send,
            retry_on=_chunk_resumable,
            attempts=4,
            backoff=CHUNK_BACKOFF,
            sleep=between_tries,
            on_retry=lambda exc, n: failed.append(exc),
        )

    # -- tokens -----------------------------------------------------------------------------------
    def tokens(self) -> list[TokenInfo]:
        """This user's live tokens: ids and times, never the secrets (`current` marks the one in use)."""
        return Tokens.model_validate(self.t.json("GET", "/auth/tokens")).tokens

    def mint_token(self, expires_in_s: float | None = None) -> TokenMinted:
        body = {} if expires_in_s is None else {"expires_in_s": expires_in_s}
        return TokenMinted.model_validate(self.t.json("POST", "/auth/tokens", json=body))

    def revoke_token(self, token_id: str) -> TokenRevoked:
        return TokenRevoked.model_validate(self.t.json("DELETE", f"/auth/tokens/{token_id}"))

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> Job:
        return Job.model_validate(self.t.json("POST", "/jobs", json=spec_json(spec)))

    def jobs(self) -> list[Job]:
        return self.job_listing().jobs

    def job_listing(self) -> Jobs:
        """Every job of this user, with the cursor of the user's event stream taken before them (follow
        `user_events(listing.cursor)` from there: nothing falls between)."""
        return Jobs.model_validate(self.t.json("GET", "/jobs"))

    def job(self, job_id: str) -> Job:
        return Job.model_validate(self.t.json("GET", f"/jobs/{job_id}"))

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self.t.json("POST", f"/jobs/{job_id}/cancel"))

    def replay(self, job_id: str, **overrides: Any) -> Job:
        return Job.model_validate(self.t.json("POST", f"/jobs/{job_id}/replay", json=overrides))

    # -- studies ----------------------------------------------------------------------------------
    def start_study(self, body: dict[str, Any]) -> Study:
        """POST /studies: `body` is the StudySpec (the oracle as the tuner says it, the trial's job spec as
        `spec_json` writes it); the backend checks it whole."""
        return Study.model_validate(self.t.json("POST", "/studies", json=body))

    def study(self, study_id: str) -> Study:
        return Study.model_validate(self.t.json("GET", f"/studies/{study_id}"))

    def cancel_study(self, study_id: str) -> Study:
        return Study.model_validate(self.t.json("POST", f"/studies/{study_id}/cancel"))

    def study_events(self, study_id: str, after: int = 0, wait: float = 0, recover: bool = True) -> dict[str, Any]:
        """A page of the study's own event log (`study` events: trials started and ended, its end) after seq
        `after`, long-polling up to `wait` s, as `events` reads a job's; the page's `status` is the study's."""
        return self._long_poll(f"/studies/{study_id}/events", {"after": after, "wait": wait}, recover)

    def events(self, job_id: str, after: int = 0, wait: float = 0, recover: bool = True) -> dict[str, Any]:
        """A page of the job's event log as it came: the events stay dicts, as the one reduction of them
        (aibro_core.jobpicture, the backend's too) and this client's own notices (`local_event`) take them."""
        return self._long_poll(f"/jobs/{job_id}/events", {"after": after, "wait": wait}, recover)

    def _long_poll(self, path: str, params: dict[str, Any], recover: bool = True) -> dict[str, Any]:
        """A long-poll, sent to the backend's event port when it announces one this client reaches (the backend
        answers it there for a tenth of the CPU: backend/aibro_backend/api/eventport.py), else to the main port."""
        timeout = float(params["wait"]) + 30
        base = self._event_port()
        if base is not None:
            try:
                return self.t.json(
                    "GET", path, params=params, timeout=(EVENT_PORT_CONNECT_S, timeout), recover=False, base=base
                )
            except BackendUnreachable:
                self._event_base = (time.monotonic(), None)  # the main port decides whether the backend is there
        return self.t.json("GET", path, params=params, timeout=timeout, recover=recover)

    def _event_port(self) -> str | None:
        """The event port's URL from `/health` (same scheme and host as this client's URL), learned once and
        again a while after it failed; None for a backend behind a path (a proxy that maps one port only)."""
        now = time.monotonic()
        if self._event_base is not None and (self._event_base[1] or now - self._event_base[0] < EVENT_PORT_RECHECK_S):
            return self._event_base[1]
        url = None
        if may_have_event_port(self.t.url):
            try:
                port = Health.model_validate(self.t.json("GET", "/health", timeout=5, recover=False)).events_port
            except (AibroError, ValueError):  # no answer, or not one this client reads: the main port serves
                port = None
            url = event_port_url(self.t.url, port)
        self._event_base = (now, url)
        return url

    def follow(self, job_id: str, after: int = 0, wait: float = 25) -> Iterator[dict[str, Any]]:
        """Every event of a job from `after`, live, until the job is final.

        When the backend stops answering, the watchers hear it from a local event (`local_event`: a "log" whose
        seq is the last one seen, so no view advances on it): "backend unreachable, restarting…" and the embedded
        backend is started again, or "retrying…" with backoff for a configured one; then "backend is back", and
        the events go on after the last seq seen, so none is lost or repeated."""
        down = 0  # failed tries in this outage
        while True:
            try:
                page = self.events(job_id, after, wait, recover=False)
            except BackendUnreachable as exc:
                if down == 0:
                    say = "restarting…" if self._restart else f"retrying… ({exc})"
                    yield local_event(job_id, after, f"backend unreachable, {say}", "warning")
                else:
                    time.sleep(FOLLOW_BACKOFF.delay(down - 1))
                down += 1
                if self._restart is not None:
                    try:
                        self.restart()
                    except BackendUnreachable as failed:
                        if down == 1:
                            yield local_event(job_id, after, f"{failed}; trying again", "warning")
                continue
            if down:
                down = 0
                yield local_event(job_id, after, f"backend is back at {self.url}; carrying on", "info")
            for ev in page["events"]:
                after = ev["seq"]
                yield ev
            if not page["events"] and page["status"] in v.JOB_FINAL:
                return

    def user_events(self, after: int = 0, wait: float = 0) -> dict[str, Any]:
        return self._long_poll("/events", {"after": after, "wait": wait})

    def artifacts(self, job_id: str) -> list[Artifact]:
        return Artifacts.model_validate(self.t.json("GET", f"/jobs/{job_id}/artifacts")).artifacts

    def download_artifact(self, job_id: str, name: str, dest: Path) -> Path:
        """Stream an artifact to `dest`; a backend keeping bytes in S3 answers a redirect to a presigned URL, which
        requests follows without the bearer token (another host or port). A download that breaks off, or S3 failing
        for now (a 5xx), starts again, for up to S3_RETRY_S (aibro_core/presigned.py)."""
        import requests

        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.aibro-part")

        def once() -> None:
            resp = self.t.request("GET", f"/jobs/{job_id}/artifacts/{name}", stream=True)
            with resp, open(part, "wb") as f:
                for chunk in resp.iter_content(1 << 20):
                    f.write(chunk)

        try:
            try:  # an unreachable backend is the caller's to handle, as before
                retry(once, retry_on=broke_off, within_s=S3_RETRY_S, backoff=S3_PART)
            except requests.RequestException as exc:
                raise BackendUnreachable(f"the download of {name} kept breaking off: {exc}") from None
            os.replace(part, dest)  # whoever reads dest (the next cell's load_model) never sees half a file
        finally:
            part.unlink(missing_ok=True)
        return dest

    # -- instances --------------------------------------------------------------------------------
    def instances(self) -> list[Instance]:
        return Instances.model_validate(self.t.json("GET", "/instances")).instances

    def terminate(self, instance_id: str) -> Instance:
        return InstanceAnswer.model_validate(self.t.json("POST", f"/instances/{instance_id}/terminate")).instance


def spec_json(spec: JobSpec) -> dict[str, Any]:
    """A job spec as it travels: its fields by their JSON names, only those that were set (the backend keeps what
    was set, and the worker hands Keras only the fit arguments the user set), so it reads back as the same spec."""
    return spec.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _chunk_resumable(exc: BaseException) -> bool:
    """A chunk's failure after which the upload goes on from what arrived: a dead backend, or 409 (an offset the
    backend does not expect, e.g. after a restart)."""
    return isinstance(exc, BackendUnreachable) or (isinstance(exc, ApiError) and exc.status == 409)


def local_event(job_id: str, seq: int, message: str, level: str = "info") -> dict[str, Any]:
    """A notice from this client to its watchers, shaped like a backend "log" event (data.local marks it): it
    carries the last seq seen, so a JobView does not advance on it, and it never reaches the backend."""
    data = {"message": message, "level": level, "local": True}
    return {"type": "log", "seq": seq, "job_id": job_id, "ts": time.time(), "data": data}
