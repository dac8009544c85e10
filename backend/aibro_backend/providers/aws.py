"""The AWS provider: each instance is an EC2 machine (spot or on-demand) whose worker enrolls with the backend.

Why it looks the way it does:

* Tags are the truth. Every instance carries `aibro:backend` (this backend), `aibro:instance` (the store's id),
  `aibro:machine`, `aibro:user`, `aibro:job` and `aibro:expires-at`, set in the same `run_instances` call. After a
  crash the backend finds its machines by tag (`adopt`), and `reconcile` terminates any tagged machine the store
  does not know or whose `aibro:expires-at` has passed, so nothing leaks money.
* No call blocks the IOLoop. boto3 is synchronous; every EC2/SSM call runs on this provider's thread pool. The
  Provider methods the scheduler's synchronous tick uses (`offers`, `launch`, `alive`, `terminate`, `reap`)
  return at once and read or update an in-memory picture; the cloud operations (`stop`, `start`, `refresh`,
  `reconcile`, `adopt`, `refresh_prices`) return a `concurrent.futures.Future`: `.done()`/`add_done_callback` from
  synchronous code, `await asyncio.wrap_future(f)` (or `IOLoop.add_future`) from coroutines.
* Launching takes time. `launch` validates, builds the user data and returns; `run_instances` runs in the pool.
  `poll(id)` reports progress, `alive` stays true while the request is in flight, and `launch_error(id)` says why
  one failed: a `CapacityError` means "pass over to the next machine in the job's list now".
* A retry never launches twice: one `ClientToken` per (instance, attempt), reused by every retry of that attempt;
  after an ambiguous failure (connection dropped, 5xx) the instance is first looked up by its tag.
* User data holds no long-lived secret: the backend's URL, the instance id and a one-time enrollment token
  (`AIBRO_ENROLL_TOKEN`, which the agent exchanges for its per-instance token). It installs a systemd unit, so
  the worker comes back after a stop/start (user data itself runs only at first boot).

Driving it from the scheduler's synchronous tick (nothing here waits on AWS):

* `launch(...)` as today, with `AIBRO_ENROLL_TOKEN` in env; the instance stays LAUNCHING while `poll(id)["state"]`
  is "launching"/"pending". When `alive()` turns false, `launch_error(id)` tells a capacity failure (emit
  `passed_over` for that machine and assign the next one in the same tick) from a worker that was lost.
* `reap()` every tick (one background listing per `refresh_interval_s`); `terminate` every tick while CLOSING
  (repeated calls share one request); `stop`/`start` for the stopped-instance policy, then read `poll(id)`.
* At start-up: `adopt()`, then `reconcile(store's live instance ids)` every few minutes; both are Futures, so
  `IOLoop.current().add_future(fut, callback)` handles their results on the loop.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aibro_core.backoff import Backoff, retry
from aibro_core.models import Machine

from ..settings import BackendSettings
from ..storage.records import InstanceRecord
from . import aws_catalog, shipping
from . import base as provider_base
from .aws_config import AwsConfig, resolve_ami
from .shipping import AgentWheel

log = logging.getLogger("aibro.aws")

# run_instances / start_instances errors that mean "this machine, not now": the scheduler tries the next one.
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "Unsupported",
    }
)
# Rate limits: back off with jitter and retry the same request.
THROTTLE_CODES = frozenset({"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"})
# Server-side failures after which the request may or may not have taken effect.
TRANSIENT_CODES = frozenset({"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable", "ServerInternal"})
LIVE_STATES = ("pending", "running", "stopping", "stopped")
GONE_STATES = ("shutting-down", "terminated")
USER_DATA_LIMIT = 16 * 1024
CA_PATH = "/etc/aibro/ca.pem"  # where a machine's bootstrap writes the backend's CA bundle (AIBRO_CA_BUNDLE)
# How long a freshly launched instance may be missing from describe_instances (EC2 is eventually consistent).
LISTING_GRACE_S = 60.0
_INSTANCE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_ENROLL_TOKEN = re.compile(r"^[A-Za-z0-9_.~-]{16,256}$")
_EXPIRES_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class AwsError(RuntimeError):
    """An EC2 call failed; `code` is AWS's error code (or the exception's type for a network failure)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class CapacityError(AwsError, provider_base.CapacityError):
    """EC2 has no room for this machine now (capacity, spot price or quota): try the next machine at once."""

    def __init__(self, machine_id: str, code: str, message: str) -> None:
        super().__init__(f"{machine_id}: no capacity now ({code}: {message})", code)
        self.machine_id = machine_id


class LaunchError(AwsError):
    """A launch failed for a reason that another machine would not fix (config, permissions, bad request)."""


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _is_network_error(exc: BaseException) -> bool:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return isinstance(exc, (BotoConnectionError, HTTPClientError))


def _worth_again(exc: BaseException) -> bool:
    """A launch or start failure that another try may not meet (never a capacity error: the scheduler moves on)."""
    code = error_code(exc)
    return code in THROTTLE_CODES or code in TRANSIENT_CODES or _is_network_error(exc)


def format_expires(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime(_EXPIRES_FORMAT)


def parse_expires(value: str | None) -> float | None:
    try:
        return dt.datetime.strptime(value or "", _EXPIRES_FORMAT).replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None


# run by the machine's own Python at first boot: the served agent, over the backend's TLS (its CA when given),
# retried while the backend is out of reach, and kept only when its SHA-256 is the one the user data names
AGENT_DOWNLOAD = """import os, ssl, sys, time, urllib.request
url = os.environ["AIBRO_WORKER_URL"] + "/api/v1/worker/agent"
ctx = ssl.create_default_context(cafile=os.environ.get("AIBRO_CA_BUNDLE") or None)
ask = urllib.request.Request(url, headers={"Authorization": "Bearer " + os.environ["AIBRO_ENROLL_TOKEN"]})
for attempt in range(40):
    try:
        data = urllib.request.urlopen(ask, timeout=120, context=ctx).read()
        break
    except OSError as exc:
        print("aibro: downloading the agent from", url, "failed:", exc, file=sys.stderr)
        time.sleep(min(30, 2 ** attempt))
else:
    sys.exit("aibro: the backend never served the agent")
with open(sys.argv[1], "wb") as f:
    f.write(data)
"""


def build_user_data(
    config: AwsConfig,
    instance_id: str,
    enroll_token: str,
    agent: AgentWheel,
    spot: bool = False,
    ca_pem: str | None = None,
    tensorflow: str | None = None,
    job_memory_bytes: int = 0,
) -> str:
    """The first-boot script: writes the worker's environment and a systemd unit that starts it on every boot.

    Everything in it is readable by anyone on the instance (and through DescribeInstanceAttribute), so it holds
    only what is harmless once used: the one-time enrollment token, which the agent exchanges for its own
    per-instance token (kept in AIBRO_WORKER_TOKEN_FILE, mode 0600, for the boots after a stop/start). `ca_pem`:
    the CA certificate(s) that verify the backend's HTTPS (public), written to /etc/aibro/ca.pem for the agent.
    The agent is the wheel this backend serves (GET /worker/agent), installed only when its SHA-256 is `agent`'s;
    its dependencies come from the image's Python when it has them (--system-site-packages), else from pip, with
    TensorFlow at `tensorflow` (the launching job's kernel's major.minor) when given. `job_memory_bytes`: what
    each job may hold of the machine's memory (scheduling/jobmemory.py; 0: no limit).
    """
    if not _INSTANCE_ID.match(instance_id):
        raise ValueError(f"instance id {instance_id!r} must be 1-40 letters, digits, '.', '_' or '-'")
    if not _ENROLL_TOKEN.match(enroll_token):
        raise ValueError("the enrollment token must be 16-256 URL-safe characters")
    if ca_pem is not None and ("AIBRO_" in ca_pem or "-----BEGIN CERTIFICATE-----" not in ca_pem):
        raise ValueError("the CA bundle must be PEM certificates (-----BEGIN CERTIFICATE-----) and nothing else")
    env = "\n".join(
        f"{k}={val}"
        for k, val in (
            ("AIBRO_WORKER_URL", config.backend_public_url),
            ("AIBRO_INSTANCE_ID", instance_id),
            ("AIBRO_ENROLL_TOKEN", enroll_token),
            ("AIBRO_WORKER_TOKEN_FILE", "/var/lib/aibro/worker-token"),
            ("AIBRO_WORKER_DIR", "/var/lib/aibro/work"),
            ("AIBRO_ENV_CACHE", "/var/lib/aibro/envs"),
            ("AIBRO_SHUTDOWN_ON_LOSS", "1"),  # a backend gone for good: the agent shuts the machine down
            *((("AIBRO_SPOT_WATCH", "1"),) if spot else ()),  # poll IMDS for the 2-minute interruption notice
            *((("AIBRO_CA_BUNDLE", CA_PATH),) if ca_pem else ()),
            *((("AIBRO_JOB_MAX_MEMORY_BYTES", str(int(job_memory_bytes))),) if job_memory_bytes > 0 else ()),
        )
    )
    ca = f"cat > {CA_PATH} <<'AIBRO_CA'\n{ca_pem.strip()}\nAIBRO_CA\nchmod 644 {CA_PATH}\n" if ca_pem else ""
    fetch = f"""python3 - "$part" <<'AIBRO_GET'\n{AGENT_DOWNLOAD}AIBRO_GET"""
    install = shipping.install_script(agent, "/opt/aibro", fetch, tensorflow)
    script = f"""#!/bin/bash
# aibro worker bootstrap (first boot only). No long-lived secret here: a one-time enrollment token that the
# agent exchanges for its per-instance token. The systemd unit brings the worker back after every stop/start.
set -euo pipefail
umask 077
mkdir -p /etc/aibro /var/lib/aibro/work /var/lib/aibro/envs
cat > /etc/aibro/worker.env <<'AIBRO_ENV'
{env}
AIBRO_ENV
{ca}set -a; . /etc/aibro/worker.env; set +a
{install}cat > /etc/systemd/system/aibro-worker.service <<'AIBRO_UNIT'
[Unit]
Description=aibro worker agent
Wants=network-online.target
After=network-online.target

[Service]
EnvironmentFile=/etc/aibro/worker.env
ExecStart=/opt/aibro/venv/bin/python -I -m aibro_backend.worker
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
AIBRO_UNIT
systemctl daemon-reload
systemctl enable --now aibro-worker.service
"""
    size = len(script.encode())
    if size > USER_DATA_LIMIT:
        fix = " (most of it the CA bundle: give only the CA that signed the backend's certificate)" if ca_pem else ""
        raise ValueError(f"user data is {size} bytes; EC2 takes at most {USER_DATA_LIMIT}{fix}")
    return script


def parse_user_data_ca(user_data: str) -> str | None:
    """The CA bundle a bootstrap script writes to /etc/aibro/ca.pem, if any (for a harness playing the machine)."""
    m = re.search(r"<<'AIBRO_CA'\n(.*?)\nAIBRO_CA\n", user_data, re.S)
    return m.group(1) + "\n" if m else None


def parse_user_data_env(user_data: str) -> dict[str, str]:
    """The worker environment a bootstrap script writes (what a test harness playing the instance runs with)."""
    m = re.search(r"<<'AIBRO_ENV'\n(.*?)\nAIBRO_ENV\n", user_data, re.S)
    if not m:
        return {}
    return dict(line.split("=", 1) for line in m.group(1).splitlines() if "=" in line)


@dataclass
class _Tracked:
    """What this process knows about one instance; written by pool threads, read by the IOLoop thread."""

    instance_id: str
    machine_id: str
    spot: bool
    user_id: int | None = None
    job_id: str | None = None
    ec2_id: str | None = None
    state: provider_base.MachineState = "launching"
    error: BaseException | None = None
    requested_at: float = 0.0
    launched_at: float | None = None
    expires_at: float | None = None
    intended_stop: bool = False
    terminate_requested: bool = False
    changed_at: float = 0.0  # when an operation last set `state`: a listing begun before then is older news
    launch: Future | None = None
    op: Future | None = None
    op_kind: str = ""

    def snapshot(self) -> AwsPoll:
        return AwsPoll(
            state=self.state,
            error=str(self.error) if self.error else None,
            capacity_error=isinstance(self.error, CapacityError),
            instance_id=self.instance_id,
            ec2_instance_id=self.ec2_id,
            machine_id=self.machine_id,
            spot=self.spot,
            user_id=self.user_id,
            job_id=self.job_id,
            launched_at=self.launched_at,
            expires_at=self.expires_at,
        )


@dataclass(frozen=True, kw_only=True)
class AwsPoll(provider_base.PollResult):
    """What this process knows of one EC2 instance (`poll`, `refresh`, `adopt`), without an AWS call."""

    instance_id: str
    ec2_instance_id: str | None
    machine_id: str
    spot: bool
    user_id: int | None
    job_id: str | None
    launched_at: float | None
    expires_at: float | None


class AwsProvider(provider_base.Provider):
    """EC2 machines from the vendored catalog, launched with this backend's tags; see the module docstring.

    `session` is a boto3 Session (default: boto3's usual credential chain, in the config's region; the standard
    AWS_ENDPOINT_URL points it at moto in tests). Calls are retried by botocore's "standard" mode (throttling,
    5xx, broken connections; `max_retries` times) except `run_instances` and `start_instances`: botocore retries
    every 5xx, and EC2 answers a capacity error with a 500, which must reach the scheduler at once so it passes
    over to the next machine. Those two go through `ec2_launch` (botocore's retries off) and are retried here on
    throttling and transient errors only, with full-jitter backoff (`backoff_base_s` doubling, capped at
    `backoff_cap_s`).
    """

    name = "aws"
    can_stop = True  # on-demand machines are stopped, kept for a fast restart
    enrolls = True  # user data is readable on the machine: the scheduler hands launch a one-time token

    def __init__(
        self,
        config: AwsConfig,
        session: Any | None = None,
        *,
        max_workers: int = 4,
        refresh_interval_s: float = 15.0,
        price_refresh_s: float = 600.0,
        max_retries: int = 5,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
        agent: AgentWheel | None = None,
    ) -> None:
        """`agent`: the wheel the backend serves its machines (built from this code when not given)."""
        import boto3
        from botocore.config import Config

        self.config = config
        self.agent = agent or shipping.served(Path(tempfile.gettempdir()) / f"aibro-agent-{os.getuid()}")
        self.session = session or boto3.Session(region_name=config.region)
        boto_config = Config(
            retries={"mode": "standard", "total_max_attempts": max_retries + 1},
            connect_timeout=5,
            read_timeout=30,
            max_pool_connections=max_workers + 2,
        )
        self.ec2 = self.session.client("ec2", region_name=config.region, config=boto_config)
        self.ssm = self.session.client("ssm", region_name=config.region, config=boto_config)
        once = boto_config.merge(Config(retries={"total_max_attempts": 1}))
        self.ec2_launch = self.session.client("ec2", region_name=config.region, config=once)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="aibro-aws")
        self.refresh_interval_s = refresh_interval_s
        self.price_refresh_s = price_refresh_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.sleep = sleep
        self.clock = clock
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._listed_at: float | None = None  # start of the last complete describe_instances listing
        self._listing: Future | None = None
        self._spot_prices: dict[str, float] = {}
        self._prices_at: float | None = None
        self._pricing: Future | None = None
        self._ami: tuple[str, float] | None = None
        self._zone: str | None = None

    # -- the marketplace ----------------------------------------------------------------------------------
    def offers(self) -> list[Machine]:
        """Catalog offers with the last spot prices read; starts a price refresh in the pool when they are old."""
        if self._prices_at is None or self.clock() - self._prices_at > self.price_refresh_s:
            self.refresh_prices()
        return aws_catalog.offers(
            self.config.region,
            self._spot_prices,
            capacity=self.config.max_instances_per_machine,
            provider=self.name,
        )

    def refresh_prices(self) -> Future:
        """Read live spot prices (one refresh at a time); on failure the offers keep their marked estimates."""
        with self._lock:
            if self._pricing is not None and not self._pricing.done():
                return self._pricing
            self._pricing = self.executor.submit(self._refresh_prices_blocking)
            return self._pricing

    def _refresh_prices_blocking(self) -> dict[str, float]:
        types = aws_catalog.instance_types(self.config.region)
        try:
            prices = aws_catalog.fetch_spot_prices(self.ec2, types, self._subnet_zone())
        except Exception as exc:  # noqa: BLE001 - prices are a nicety; offers fall back to marked estimates
            log.warning("could not read spot prices in %s: %s", self.config.region, exc)
            self._prices_at = self.clock()
            return dict(self._spot_prices)
        self._spot_prices = prices
        self._prices_at = self.clock()
        return dict(prices)

    def _subnet_zone(self) -> str | None:
        if self._zone is None:
            try:
                subnets = self.ec2.describe_subnets(SubnetIds=[self.config.subnet_id])["Subnets"]
                self._zone = subnets[0]["AvailabilityZone"] if subnets else ""
            except Exception as exc:  # noqa: BLE001 - without the zone, prices of every zone are read
                log.warning("could not read subnet %s: %s", self.config.subnet_id, exc)
                return None
        return self._zone or None

    # -- calling AWS ---------------------------------------------------------------------------------------
    def _retrying(self, fn: Callable[[], Any], what: str) -> Any:
        """Run `fn` (a call on `ec2_launch`), again on throttling and transient errors but never on capacity ones,
        with full-jitter backoff (bounded)."""

        def said(exc: Exception, attempt: int) -> None:
            log.info(
                "%s: %s; retrying (%d/%d)", what, error_code(exc) or type(exc).__name__, attempt + 1, self.max_retries
            )

        return retry(
            fn,
            retry_on=_worth_again,
            attempts=self.max_retries + 1,
            backoff=Backoff(self.backoff_base_s, self.backoff_cap_s, jitter=True),
            sleep=self.sleep,
            on_retry=said,
        )

    def _resolve_ami(self) -> str:
        """The AMI to boot, resolved through SSM at most once an hour (blocking; pool threads only)."""
        now = self.clock()
        if self._ami is None or now - self._ami[1] > 3600:
            ami = resolve_ami(self.config, self.ssm)
            self._ami = (ami, now)
        return self._ami[0]

    def client_token(self, instance_id: str, attempt: int = 0) -> str:
        """run_instances' idempotency token: the same for every retry of one attempt, unique per backend."""
        backend = hashlib.sha256(self.config.backend_id.encode()).hexdigest()[:8]
        return f"aibro-{backend}-{instance_id}-{attempt}"[:64]

    def _list(self, states: Iterable[str], instance_id: str | None = None) -> list[dict[str, Any]]:
        """This backend's instances in `states` (blocking). Filters on our own tags only: moto lacks many."""
        filters = [
            {"Name": "tag:aibro:backend", "Values": [self.config.backend_id]},
            {"Name": "instance-state-name", "Values": list(states)},
        ]
        if instance_id:
            filters.append({"Name": "tag:aibro:instance", "Values": [instance_id]})

        found = []
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page.get("Reservations", []):
                found.extend(reservation.get("Instances", []))
        return found

    # -- launching -----------------------------------------------------------------------------------------
    def launch(self, request: provider_base.LaunchRequest) -> None:
        """Request the machine and return at once (no pid: the instance is found by its tag).

        `env` must hold `AIBRO_ENROLL_TOKEN`, a one-time token; `AIBRO_WORKER_TOKEN` (long-lived) is never put in
        the user data. Bad input raises ValueError here; EC2's answer comes later through `poll`/`alive`/
        `launch_error`/`launch_future`. Launching an instance id already launched (and not failed) does nothing.
        """
        instance_id, machine_id, attempt = request.instance_id, request.machine_id, request.attempt
        instance_type, spot = aws_catalog.parse_machine_id(machine_id)
        if aws_catalog.row(self.config.region, instance_type) is None:
            raise ValueError(f"{machine_id} is not an AWS machine offered in {self.config.region}")
        token = request.env.get("AIBRO_ENROLL_TOKEN")
        if not token:
            raise ValueError(
                "the AWS provider needs a one-time enrollment token in env AIBRO_ENROLL_TOKEN (the long-lived "
                "AIBRO_WORKER_TOKEN never goes into user data)"
            )
        user_data = build_user_data(
            self.config,
            instance_id,
            token,
            self.agent,
            spot=spot,
            ca_pem=_backend_ca(),
            tensorflow=request.tensorflow,
            job_memory_bytes=int(request.env.get("AIBRO_JOB_MAX_MEMORY_BYTES") or 0),  # written back as a number
        )
        with self._lock:
            known = self._tracked.get(instance_id)
            if known is not None and known.state not in ("failed", "terminated"):
                return None
            now = self.clock()
            tracked = _Tracked(
                instance_id=instance_id,
                machine_id=machine_id,
                spot=spot,
                user_id=request.user_id,
                job_id=request.job_id,
                requested_at=now,
                expires_at=now + self.config.max_instance_hours * 3600,
            )
            self._tracked[instance_id] = tracked
            tracked.launch = self.executor.submit(self._launch_blocking, tracked, instance_type, user_data, attempt)
        return None

    def _tags(self, t: _Tracked) -> list[dict[str, str]]:
        tags = {
            "Name": f"aibro {t.instance_id} ({t.machine_id})",
            **self.config.tags,
            "aibro:backend": self.config.backend_id,
            "aibro:instance": t.instance_id,
            "aibro:machine": t.machine_id,
            "aibro:user": "" if t.user_id is None else str(t.user_id),
            "aibro:expires-at": format_expires(t.expires_at or 0),
        }
        if t.job_id:
            tags["aibro:job"] = t.job_id
        return [{"Key": k, "Value": val} for k, val in tags.items()]

    def run_instances_params(self, t: _Tracked, instance_type: str, user_data: str, ami: str) -> dict[str, Any]:
        tags = self._tags(t)
        kinds = ["instance", "volume"] + (["spot-instances-request"] if t.spot else [])
        params: dict[str, Any] = {
            "ImageId": ami,
            "InstanceType": instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "SubnetId": self.config.subnet_id,
            "SecurityGroupIds": list(self.config.security_group_ids),
            "IamInstanceProfile": self.config.instance_profile_spec,
            "UserData": user_data,  # boto3 base64-encodes it
            "TagSpecifications": [{"ResourceType": kind, "Tags": tags} for kind in kinds],
            # IMDSv2 only, one hop: a container on the instance cannot reach the instance's credentials
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1},
            # A one-time spot instance cannot be stopped: a shutdown from inside terminates it. An on-demand one
            # that shuts itself down (its agent lost the backend) is stopped, so it can still be restarted, and the
            # reconciler terminates it if the store does not want it.
            "InstanceInitiatedShutdownBehavior": "terminate" if t.spot else "stop",
        }
        if t.spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        if self.config.key_name:
            params["KeyName"] = self.config.key_name
        return params

    def _launch_blocking(self, t: _Tracked, instance_type: str, user_data: str, attempt: int) -> str:
        try:
            ami = self._resolve_ami()
            params = self.run_instances_params(t, instance_type, user_data, ami)
            params["ClientToken"] = self.client_token(t.instance_id, attempt)
            instance = self._run_idempotent(t, params)
        except Exception as exc:
            t.error = self._launch_failure(t, exc)
            self._moved(t, "failed")
            log.warning("launch of %s (%s) failed: %s", t.instance_id, t.machine_id, t.error)
            raise t.error from exc
        t.ec2_id = instance["InstanceId"]
        self._moved(t, instance.get("State", {}).get("Name", "pending"))
        t.launched_at = self.clock()
        log.info("launched %s as %s (%s)", t.instance_id, t.ec2_id, t.machine_id)
        if t.terminate_requested:  # terminated while the request was in flight
            self._terminate_blocking(t)
        return t.ec2_id

    def _run_idempotent(self, t: _Tracked, params: dict[str, Any]) -> dict[str, Any]:
        """run_instances with bounded retries; after an ambiguous failure, look for the instance before retrying."""
        ambiguous = False

        def run() -> dict[str, Any]:
            nonlocal ambiguous
            if ambiguous:
                found = self._list(LIVE_STATES, t.instance_id)
                if found:
                    log.info("%s was launched by an earlier try (%s)", t.instance_id, found[0]["InstanceId"])
                    return found[0]
            try:
                return self.ec2_launch.run_instances(**params)["Instances"][0]
            except Exception as exc:
                ambiguous = error_code(exc) in TRANSIENT_CODES or _is_network_error(exc)
                raise

        return self._retrying(run, f"run_instances for {t.instance_id}")

    def _launch_failure(self, t: _Tracked, exc: Exception) -> AwsError:
        code = error_code(exc)
        message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", "")) if code else str(exc)
        if code in CAPACITY_CODES:
            return CapacityError(t.machine_id, code, message or str(exc))
        return LaunchError(f"could not launch {t.machine_id}: {code or type(exc).__name__}: {message}", code)

    def launch_future(self, instance_id: str) -> Future | None:
        """The launch's Future (result: the EC2 instance id; exception: CapacityError or LaunchError)."""
        t = self._tracked.get(instance_id)
        return t.launch if t else None

    def launch_error(self, instance_id: str) -> AwsError | None:
        """Why the launch failed, once it has; None while pending or after success."""
        t = self._tracked.get(instance_id)
        return t.error if t is not None and isinstance(t.error, AwsError) else None

    def poll(self, instance_id: str) -> AwsPoll | None:
        """What this process knows about an instance now (no AWS call): state, EC2 id, error, times."""
        t = self._tracked.get(instance_id)
        return t.snapshot() if t else None

    # -- the Provider interface the scheduler's tick uses -------------------------------------------------------
    def alive(self, instance: InstanceRecord) -> bool:
        """True while the request is in flight or the machine runs (or was stopped by us); no AWS call.

        An id this process has never seen (a backend restart before `adopt`) counts as alive until a complete
        listing made since start says it is not there.
        """
        t = self._tracked.get(instance.id)
        if t is None or t.state == "unknown":
            if self._listed_at is None:
                self.refresh()
                return True
            return t is not None and t.op is not None and not t.op.done()
        if t.state in ("launching", "pending", "running"):
            return True
        if t.state in ("stopping", "stopped"):
            return t.intended_stop
        return False

    def reap(self) -> None:
        """Called every tick: keeps the picture fresh with one background listing every `refresh_interval_s`."""
        if self._listed_at is None or self.clock() - self._listed_at >= self.refresh_interval_s:
            self.refresh()

    def terminate(self, instance: InstanceRecord) -> Future:
        """Make sure the instance goes away; returns at once (a Future). Repeated calls share one request."""
        t = self._track_for(instance)
        t.terminate_requested = True
        with self._lock:
            if t.state == "launching" and t.launch is not None and not t.launch.done():
                # _launch_blocking terminates it as soon as run_instances answers (or fails)
                after: Future = Future()
                t.launch.add_done_callback(lambda _f: after.set_result(t.state))
                return after
            if t.op is not None and not t.op.done() and t.op_kind == "terminate":
                return t.op
            return self._submit_op(t, "terminate", self._terminate_blocking, t)

    def _submit_op(self, t: _Tracked, kind: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run one stop/start/terminate of an instance after the one before it (call with the lock held).

        The pool is FIFO, so the previous op has started before this one waits for it: no deadlock."""
        prev = t.op

        def run() -> Any:
            if prev is not None:
                try:
                    prev.result()
                except Exception:  # noqa: BLE001 - the previous op's caller sees its error; this one goes on
                    pass
            return fn(*args)

        t.op, t.op_kind = self.executor.submit(run), kind
        return t.op

    def _track_for(self, instance: InstanceRecord) -> _Tracked:
        with self._lock:
            t = self._tracked.get(instance.id)
            if t is None:
                machine = instance.machine_id or ""
                t = _Tracked(instance.id, machine, aws_catalog.parse_machine_id(machine)[1], state="unknown")
                self._tracked[instance.id] = t
            return t

    def _moved(self, t: _Tracked, state: str) -> None:
        """An operation's own answer: newer than any listing begun before it (`_refresh_blocking` keeps it)."""
        t.state, t.changed_at = state, self.clock()

    def _ec2_id(self, t: _Tracked) -> str | None:
        if t.ec2_id is None:
            found = self._list((*LIVE_STATES, "shutting-down"), t.instance_id)
            if found:
                t.ec2_id = found[0]["InstanceId"]
                self._moved(t, found[0]["State"]["Name"])
        return t.ec2_id

    def _terminate_blocking(self, t: _Tracked) -> str:
        if self._ec2_id(t) is None:
            self._moved(t, "terminated" if t.state != "failed" else t.state)
            return t.state
        out = self.ec2.terminate_instances(InstanceIds=[t.ec2_id])
        self._moved(t, out["TerminatingInstances"][0]["CurrentState"]["Name"])
        log.info("terminating %s (%s)", t.instance_id, t.ec2_id)
        return t.state

    # -- what a cloud adds: stop / start, listing, reconciling, adopting ------------------------------------------
    def stop(self, instance: InstanceRecord) -> Future:
        """Stop an on-demand instance (its disk stays; a later `start` is a fast restart). Spot ones cannot be."""
        t = self._track_for(instance)
        if t.spot:
            raise ValueError(f"{t.instance_id} is a one-time spot instance ({t.machine_id}): terminate it instead")
        t.intended_stop = True
        with self._lock:
            return self._submit_op(t, "stop", self._stop_blocking, t)

    def _stop_blocking(self, t: _Tracked) -> str:
        if self._ec2_id(t) is None:
            raise AwsError(f"{t.instance_id} has no EC2 instance to stop", "NotFound")
        out = self.ec2.stop_instances(InstanceIds=[t.ec2_id])
        self._moved(t, out["StoppingInstances"][0]["CurrentState"]["Name"])
        return t.state

    def start(self, instance: InstanceRecord, stopping_wait_s: float = 120.0) -> Future:
        """Start a stopped instance again and renew its aibro:expires-at. A capacity error raises CapacityError."""
        t = self._track_for(instance)
        with self._lock:
            return self._submit_op(t, "start", self._start_blocking, t, stopping_wait_s)

    def _start_blocking(self, t: _Tracked, stopping_wait_s: float) -> str:
        if self._ec2_id(t) is None:
            raise AwsError(f"{t.instance_id} has no EC2 instance to start", "NotFound")
        deadline = self.clock() + stopping_wait_s
        while t.state == "stopping" and self.clock() < deadline:  # EC2 refuses to start a stopping instance
            self.sleep(5)
            found = self._list(LIVE_STATES, t.instance_id)
            self._moved(t, found[0]["State"]["Name"] if found else "terminated")
        t.expires_at = self.clock() + self.config.max_instance_hours * 3600
        self.ec2.create_tags(
            Resources=[t.ec2_id],
            Tags=[{"Key": "aibro:expires-at", "Value": format_expires(t.expires_at)}],
        )
        try:
            out = self._retrying(lambda: self.ec2_launch.start_instances(InstanceIds=[t.ec2_id]), "start_instances")
        except Exception as exc:
            if error_code(exc) in CAPACITY_CODES:
                raise self._launch_failure(t, exc) from exc
            raise
        t.intended_stop = False
        self._moved(t, out["StartingInstances"][0]["CurrentState"]["Name"])
        return t.state

    def refresh(self) -> Future:
        """List this backend's instances once (in the pool) and update every tracked state; one at a time."""
        with self._lock:
            if self._listing is not None and not self._listing.done():
                return self._listing
            self._listing = self.executor.submit(self._refresh_blocking)
            return self._listing

    def _refresh_blocking(self) -> dict[str, AwsPoll]:
        started = self.clock()
        found: dict[str, dict[str, Any]] = {}
        for inst in self._list((*LIVE_STATES, *GONE_STATES)):
            iid = tag_map(inst).get("aibro:instance", "")
            if iid and (iid not in found or found[iid]["State"]["Name"] in GONE_STATES):
                found[iid] = inst  # a live instance wins over a terminated one of the same id
        with self._lock:
            for iid, inst in found.items():
                t = self._tracked.get(iid)
                if t is None:
                    t = self._tracked[iid] = self._from_listing(inst)
                if t.state != "launching" and t.changed_at < started:
                    t.ec2_id, t.state = inst["InstanceId"], inst["State"]["Name"]
            for iid, t in self._tracked.items():
                if iid in found or t.state in ("launching", "failed", *GONE_STATES) or t.changed_at >= started:
                    continue
                if t.launched_at is not None and t.launched_at > started - LISTING_GRACE_S:
                    continue  # too new to be listed yet
                t.state = "terminated"
            self._listed_at = started
            return {iid: t.snapshot() for iid, t in self._tracked.items()}

    def _from_listing(self, inst: dict[str, Any]) -> _Tracked:
        tags = tag_map(inst)
        machine = tags.get("aibro:machine", "")
        user = tags.get("aibro:user", "")
        launched = inst.get("LaunchTime")
        state = inst["State"]["Name"]
        return _Tracked(
            instance_id=tags["aibro:instance"],
            machine_id=machine,
            spot=inst.get("InstanceLifecycle") == "spot" or aws_catalog.parse_machine_id(machine)[1],
            user_id=int(user) if user.isdigit() else None,
            job_id=tags.get("aibro:job"),
            ec2_id=inst["InstanceId"],
            state=state,
            launched_at=launched.timestamp() if isinstance(launched, dt.datetime) else None,
            expires_at=parse_expires(tags.get("aibro:expires-at")),
            intended_stop=state in ("stopping", "stopped"),
        )

    def reconcile(self, known_instance_ids: Iterable[str]) -> Future:
        """Terminate every instance of this backend that the store does not know or whose aibro:expires-at has
        passed (a missing or unreadable expiry counts as passed). Future result: the EC2 ids it terminated.

        Instances launched by this process after this call are spared: `known_instance_ids` was read before.
        """
        known = set(known_instance_ids)
        since = self.clock()
        return self.executor.submit(self._reconcile_blocking, known, since)

    def _reconcile_blocking(self, known: set[str], since: float) -> list[str]:
        now = self.clock()
        victims: list[tuple[str, str, str]] = []
        for inst in self._list(LIVE_STATES):
            tags = tag_map(inst)
            iid = tags.get("aibro:instance", "")
            t = self._tracked.get(iid)
            if t is not None and (t.state == "launching" or t.requested_at >= since):
                continue
            expires = parse_expires(tags.get("aibro:expires-at"))
            if not iid or iid not in known:
                victims.append((inst["InstanceId"], iid, "unknown to the store"))
            elif expires is None or expires <= now:
                victims.append((inst["InstanceId"], iid, f"expired ({tags.get('aibro:expires-at')})"))
        ids = [v[0] for v in victims]
        for i in range(0, len(ids), 100):
            self.ec2.terminate_instances(InstanceIds=ids[i : i + 100])
        for ec2_id, iid, why in victims:
            log.warning("reconcile: terminated %s (%s): %s", ec2_id, iid or "no aibro:instance tag", why)
            t = self._tracked.get(iid)
            if t is not None:
                t.state, t.terminate_requested = "shutting-down", True
        return ids

    def adopt(self) -> Future:
        """Find this backend's live instances by tag (after a restart) and track them; Future result: an AwsPoll per
        instance."""
        return self.executor.submit(self._adopt_blocking)

    def _adopt_blocking(self) -> list[AwsPoll]:
        started = self.clock()
        adopted = []
        for inst in self._list(LIVE_STATES):
            if "aibro:instance" not in tag_map(inst):
                continue
            t = self._from_listing(inst)
            with self._lock:
                current = self._tracked.get(t.instance_id)
                if current is None or current.state in ("unknown", "launching"):
                    self._tracked[t.instance_id] = t
                else:
                    t = current
            adopted.append(t.snapshot())
        with self._lock:
            if self._listed_at is None:
                self._listed_at = started
        return adopted

    def close(self) -> None:
        """Stop the pool without waiting (queued calls are dropped; running ones finish on their own)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def _backend_ca() -> str | None:
    """The CA bundle workers verify this backend with (`serve --ca-bundle`, AIBRO_CA_BUNDLE), as PEM text."""
    path = BackendSettings.from_env().ca_bundle
    if not path:
        return None
    with open(path, encoding="ascii") as f:
        return f.read()


def tag_map(instance: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
