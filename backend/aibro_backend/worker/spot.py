"""The spot-interruption watch of a worker on a spot machine: polls the instance metadata service (IMDSv2).

AWS gives a spot machine two minutes' notice before it reclaims it: `latest/meta-data/spot/instance-action`
answers 404 until then, and then `{"action": "terminate" | "stop" | "hibernate", "time": "...Z"}`. Every notice
means "this machine goes away", so any action sets `notice`. The rebalance recommendation
(`latest/meta-data/events/recommendations/rebalance`) only says the machine is at elevated risk; it often comes
long before an interruption, or without one, and acting on it would restart a job for nothing, so it is reported
(`on_rebalance`) but does not stop training: the two-minute notice is enough to stop at a batch boundary, because
the last epoch's checkpoint is already uploaded or nearly so.

IMDSv2 needs a session token (PUT `latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`) sent as
`X-aws-ec2-metadata-token` on every read; a 401 means the token expired and a new one is fetched. The base URL is
AIBRO_IMDS_URL (default http://169.254.169.254), so a test points it at a fake server. The watch runs only when
AIBRO_SPOT_WATCH=1, which the AWS provider's user data sets on spot machines.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import requests

log = logging.getLogger("aibro.worker")
DEFAULT_IMDS_URL = "http://169.254.169.254"
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_S = 21600
POLL_S = 5.0
REQUEST_TIMEOUT_S = 2.0


class SpotWatch:
    """Polls IMDSv2 every `interval_s` on a daemon thread; `notice` is set (once, for good) when AWS announces the
    interruption, and `detail` then holds its JSON answer."""

    def __init__(
        self,
        base_url: str = DEFAULT_IMDS_URL,
        interval_s: float = POLL_S,
        on_rebalance: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self.on_rebalance = on_rebalance
        self.notice = threading.Event()
        self.detail: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None
        self._token: str | None = None
        self._session = requests.Session()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SpotWatch:
        self._thread = threading.Thread(target=self._run, name="aibro-spot-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S * 3)

    def describe(self) -> str:
        """The notice in words (for the job's log and the finish report)."""
        d = self.detail or {}
        return f"AWS announced a spot interruption ({d.get('action', 'terminate')} at {d.get('time', 'soon')})"

    def check(self) -> bool:
        """One poll of both paths; True once an interruption is announced. Network trouble is logged, not raised:
        IMDS is link-local and a hiccup must not stop training."""
        try:
            action = self._get(INSTANCE_ACTION)
            if action is not None and not self.notice.is_set():
                self.detail = _as_dict(action)
                log.warning("%s", self.describe())
                self.notice.set()
            if self.rebalance is None:
                rebalance = self._get(REBALANCE)
                if rebalance is not None:
                    self.rebalance = _as_dict(rebalance)
                    log.warning("AWS recommends a rebalance: this spot machine is at elevated risk of interruption")
                    if self.on_rebalance is not None:
                        self.on_rebalance(self.rebalance)
        except requests.RequestException as exc:
            log.info("instance metadata unreachable (%s); trying again", exc)
        return self.notice.is_set()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.check():
            self._stop.wait(self.interval_s)

    def _get(self, path: str) -> str | None:
        """The body at `path`, or None while it is 404 (no notice yet)."""
        for _ in range(2):
            if self._token is None:
                resp = self._session.put(
                    self.base_url + TOKEN_PATH,
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                    timeout=REQUEST_TIMEOUT_S,
                )
                resp.raise_for_status()
                self._token = resp.text.strip()
            resp = self._session.get(
                self.base_url + path, headers={"X-aws-ec2-metadata-token": self._token}, timeout=REQUEST_TIMEOUT_S
            )
            if resp.status_code == 401:
                self._token = None
                continue
            if resp.status_code == 404:
                return None
            resp.raise_for_status()
            return resp.text
        return None


def _as_dict(body: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {"raw": body[:500]}
    return value if isinstance(value, dict) else {"raw": str(value)[:500]}


def spot_watch_from_env(
    env: Mapping[str, str], on_rebalance: Callable[[dict[str, Any]], None] | None = None
) -> SpotWatch | None:
    """A started watch when this worker runs on a spot machine (AIBRO_SPOT_WATCH=1); None elsewhere (local
    workers, on-demand machines)."""
    from .settings import WorkerSettings  # here: the settings' defaults are this module's

    settings = WorkerSettings.from_env(env)
    if not settings.spot_watch:
        return None
    return SpotWatch(settings.imds_url, settings.spot_poll_s, on_rebalance).start()
