"""One backoff schedule for every retry (issue 25 item 4): it doubles from its first delay up to its cap, and with
jitter stays within that bound; one retry loop (issue 36 item 4) tries again only on the failures it is told of, up
to its bounds, waiting that schedule between tries."""

from __future__ import annotations

import pytest
import requests

from aibro_core import presigned
from aibro_core.backoff import S3_PART, WORKER, Backoff, retry
from aibro_core.errors import ApiError, BackendUnreachable
from aibro_jupyter.client import BackendClient
from aibro_jupyter.config import Target

pytestmark = pytest.mark.fast


def test_it_doubles_up_to_its_cap() -> None:
    assert [WORKER.delay(n) for n in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert S3_PART.jitter and all(0 <= S3_PART.delay(n) <= min(4.0, 0.5 * 2**n) for n in range(8) for _ in range(20))
    assert WORKER.delay(10_000) == 2.0, "a long outage never overflows"


def test_jitter_stays_within_the_bound() -> None:
    b = Backoff(0.5, 8.0, jitter=True)
    for n in range(8):
        assert all(0 <= b.delay(n) <= min(8.0, 0.5 * 2**n) for _ in range(50))


def flaky(failures: list[Exception], result: str = "done"):
    def call() -> str:
        if failures:
            raise failures.pop(0)
        return result

    return call


def test_retry_tries_again_on_what_it_is_told_of_waiting_the_schedule() -> None:
    sleeps: list[float] = []
    heard: list[tuple[str, int]] = []
    call = flaky([OSError("a"), TimeoutError("b")])
    got = retry(call, retry_on=OSError, sleep=sleeps.append, on_retry=lambda e, n: heard.append((str(e), n)))
    assert got == "done" and sleeps == [0.2, 0.4] and heard == [("a", 0), ("b", 1)]
    with pytest.raises(KeyError):  # anything else goes through at once
        retry(flaky([KeyError("x")]), retry_on=lambda e: isinstance(e, OSError), sleep=sleeps.append)
    assert len(sleeps) == 2


def test_retry_gives_up_at_its_bounds_with_the_last_failure() -> None:
    sleeps: list[float] = []
    with pytest.raises(OSError, match="3"):
        retry(
            flaky([OSError("1"), OSError("2"), OSError("3"), OSError("4")]),
            retry_on=OSError,
            attempts=3,
            backoff=Backoff(0.5, 4.0),
            sleep=sleeps.append,
        )
    assert sleeps == [0.5, 1.0]
    now = [0.0]

    def later(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(OSError, match="2"):
        retry(
            flaky([OSError(str(n)) for n in range(10)]),
            retry_on=OSError,
            within_s=0.5,
            sleep=later,
            clock=lambda: now[0],
        )
    assert now[0] == pytest.approx(0.2 + 0.4)  # the try after 0.6 s is the last


class FakeS3:
    """Answers each PUT with the next status of `statuses`."""

    def __init__(self, *statuses: int) -> None:
        self.statuses, self.puts = list(statuses), 0

    def put(self, url: str, **kw: object) -> requests.Response:
        self.puts += 1
        resp = requests.Response()
        resp.status_code, resp._content = self.statuses.pop(0), b"<Error><Code>SlowDown</Code></Error>"
        resp.headers["ETag"] = '"e"'
        return resp


def test_a_presigned_part_is_sent_again_after_a_5xx_never_after_a_4xx() -> None:
    part = {"url": "https://s3.test/part", "number": 1}
    s3 = FakeS3(503, 200)
    assert presigned._put(s3, part, b"x") == '"e"' and s3.puts == 2  # type: ignore[arg-type]
    s3 = FakeS3(403, 200)
    with pytest.raises(ApiError) as refused:
        presigned._put(s3, part, b"x")  # type: ignore[arg-type]
    assert refused.value.status == 403 and s3.puts == 1


class FakeBackend:
    """A transport whose PUTs follow a script (an exception, or a reply) and whose HEAD answers `received`."""

    def __init__(self, *puts: object, received: int = 0, held: bool = False) -> None:
        self.puts, self.sent, self.received, self.held = list(puts), [], received, held
        self.url, self.token = "http://127.0.0.1:9", "t"  # what a restart points the client at

    def json(self, method: str, path: str, params: dict, data: object, recover: bool) -> dict:
        self.sent.append(params["offset"])
        step = self.puts.pop(0)
        if isinstance(step, Exception):
            raise step
        return step  # type: ignore[return-value]

    def request(self, method: str, path: str) -> requests.Response:
        resp = requests.Response()
        resp.status_code = 200
        resp.headers["X-Received"] = str(self.received)
        if self.held:
            resp.headers["X-Blob-Size"] = "10"
        return resp


def test_an_upload_chunk_goes_on_from_what_arrived_after_a_409_or_a_restarted_backend() -> None:
    client = BackendClient("http://127.0.0.1:9", "t", restart=lambda: Target("http://127.0.0.1:9", "t", True))
    client.notify = lambda message: None
    client.t = FakeBackend(ApiError(409, "resume from 4"), {"complete": True, "received": 10}, received=4)  # type: ignore[assignment]
    assert client._put_chunk("/blobs/x", memoryview(b"0123456789"), 0, 10) == 10
    assert client.t.sent == [0, 4], "the rest, from what the backend holds"  # type: ignore[attr-defined]
    client.t = FakeBackend(BackendUnreachable("gone"), held=True)  # type: ignore[assignment]
    assert client._put_chunk("/blobs/x", memoryview(b"0123456789"), 0, 10) == 10  # restarted: it holds it all
    client.t = FakeBackend(*[ApiError(409, "in progress")] * 4)  # type: ignore[assignment]
    with pytest.raises(ApiError, match="in progress"):
        client._put_chunk("/blobs/x", memoryview(b"0123456789"), 0, 10)
    assert len(client.t.sent) == 4, "four tries at the most"  # type: ignore[attr-defined]
