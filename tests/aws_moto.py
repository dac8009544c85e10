"""moto's server mode for tests that run a real backend with the AWS provider: a ThreadedMotoServer on a free
port with fake credentials (nothing can reach a real account), the account a user sets up once (VPC, subnet,
security group, bucket, instance profile, SSM parameter naming the AMI), and a config file naming it."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REGION = "us-east-1"
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}
DROPPED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


# moto answers every spot price with $0.00001. Tests whose pictures a user sees ask for prices shaped like AWS's:
# a share of the catalog's on-demand price by family (the usual 55-70 % spot discount on GPU instances).
SPOT_SHARE = {"g4dn": 0.30, "g5": 0.36, "g6": 0.41, "p3": 0.31, "p4d": 0.45}


@contextmanager
def _realistic_spot_prices() -> Iterator[None]:
    from moto.ec2.responses.spot_instances import SpotInstances

    from aibro_backend.providers import aws_catalog

    answer = SpotInstances.describe_spot_price_history

    def describe(self: Any) -> Any:
        result = answer(self)
        for entry in result.result["SpotPriceHistory"]:  # type: ignore[attr-defined]
            kind = entry["InstanceType"]
            found = aws_catalog.row(self.region, kind)
            if found is not None:
                share = SPOT_SHARE.get(kind.split(".")[0], aws_catalog.SPOT_ESTIMATE_FRACTION)
                entry["SpotPrice"] = f"{found.on_demand_price_per_hour * share:.4f}"
        return result

    SpotInstances.describe_spot_price_history = describe  # type: ignore[method-assign]
    try:
        yield
    finally:
        SpotInstances.describe_spot_price_history = answer  # type: ignore[method-assign]


@contextmanager
def moto_server(realistic_spot: bool = False) -> Iterator[dict[str, str]]:
    """A moto server; yields the environment (fake credentials, AWS_ENDPOINT_URL) that points boto3 at it, also
    set in this process while it runs. `realistic_spot`: spot prices shaped like AWS's, not moto's $0.00001."""
    from moto.server import ThreadedMotoServer

    if realistic_spot:
        with _realistic_spot_prices(), moto_server() as env:
            yield env
        return

    saved = {k: os.environ.get(k) for k in (*FAKE_AWS_ENV, *DROPPED, "AWS_ENDPOINT_URL")}
    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    env = {**FAKE_AWS_ENV, "AWS_ENDPOINT_URL": f"http://localhost:{port}"}
    for key in DROPPED:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_account() -> dict[str, Any]:
    """What a user sets up once, made in moto."""
    import boto3

    session = boto3.Session(region_name=REGION)
    ec2 = session.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]
    sg = ec2.create_security_group(GroupName=f"aibro-{uuid.uuid4().hex[:6]}", Description="aibro", VpcId=vpc)
    ami = ec2.describe_images(Filters=[{"Name": "name", "Values": ["amzn2-ami-hvm-*"]}])["Images"][0]["ImageId"]
    bucket = f"aibro-{uuid.uuid4().hex[:8]}"
    session.client("s3").create_bucket(Bucket=bucket)
    iam = session.client("iam")
    name = f"aibro-worker-{uuid.uuid4().hex[:6]}"
    iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17"}))
    iam.create_instance_profile(InstanceProfileName=name)
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    param = f"/aibro/{uuid.uuid4().hex[:6]}/ami"
    session.client("ssm").put_parameter(Name=param, Value=ami, Type="String")
    return {
        "session": session,
        "ec2": ec2,
        "subnet": subnet["SubnetId"],
        "sg": sg["GroupId"],
        "bucket": bucket,
        "profile": name,
        "ami_parameter": param,
        "ami": ami,
    }


def write_config(path: Path, account: dict[str, Any], **over: Any) -> Path:
    """A TOML config naming the account (keys in `over` replace or, when None, drop the defaults)."""
    raw: dict[str, Any] = {
        "region": REGION,
        "subnet_id": account["subnet"],
        "security_group_ids": [account["sg"]],
        "s3_bucket": account["bucket"],
        "s3_prefix": "jobs",
        "instance_profile": account["profile"],
        "ami_ssm_parameter": account["ami_parameter"],
        "backend_public_url": "https://aibro.example.test:8888",
        "backend_id": f"test-{uuid.uuid4().hex[:8]}",
        "max_instance_hours": 2,
    }
    raw.update(over)
    lines = ["# aibro AWS provider (test)"]
    for key, value in raw.items():
        if value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


class PlayedInstances:
    """The test harness plays each EC2 instance that moto says is running for this backend: it reads the user
    data moto stored, decodes the worker environment the bootstrap would write (parse_user_data_env) and runs the
    real agent as a local process with it, the way the systemd unit would (`python -I -m aibro_backend.worker`).
    Only where the machine's disk and network differ is the environment remapped: its /var/lib/aibro paths go
    under `root/<ec2 id>/`, the backend's public URL becomes the test backend's real one, and AWS calls go to
    moto. A machine moto reports stopped or terminated has its agent killed, as the real one would be."""

    def __init__(
        self,
        backend_id: str,
        backend_url: str,
        root: Path,
        aws_env: dict[str, str],
        machine_env: Callable[[str], dict[str, str]] | None = None,
    ) -> None:
        """`machine_env(ec2_id)`: what else differs on that machine (its own fake instance metadata service)."""
        self.machine_env = machine_env
        self.backend_id = backend_id
        self.backend_url = backend_url
        self.root = root
        self.aws_env = aws_env
        self.procs: dict[str, Any] = {}  # ec2 id -> Popen
        self.envs: dict[str, dict[str, str]] = {}
        self._stop = False
        self._thread: Any = None

    def __enter__(self) -> PlayedInstances:
        import threading

        self._thread = threading.Thread(target=self._run, name="played-instances", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        for ec2_id in list(self.procs):
            self._kill(ec2_id)

    def _run(self) -> None:
        import time

        import boto3

        ec2 = boto3.Session(region_name=REGION).client("ec2")
        while not self._stop:
            try:
                pages = ec2.describe_instances(Filters=[{"Name": "tag:aibro:backend", "Values": [self.backend_id]}])
                for inst in (i for r in pages["Reservations"] for i in r["Instances"]):
                    state, ec2_id = inst["State"]["Name"], inst["InstanceId"]
                    if state == "running" and ec2_id not in self.procs:
                        self._boot(ec2, ec2_id)
                    elif state != "running" and ec2_id in self.procs:
                        self._kill(ec2_id)
            except Exception as exc:  # noqa: BLE001 - a hiccup of the poll: try again
                print(f"played instances: {exc!r}", flush=True)
            time.sleep(0.2)

    def _boot(self, ec2: Any, ec2_id: str) -> None:
        import base64
        import subprocess
        import sys

        from aibro_backend.providers.aws import parse_user_data_ca, parse_user_data_env

        raw = ec2.describe_instance_attribute(InstanceId=ec2_id, Attribute="userData")["UserData"]
        user_data = base64.b64decode(raw["Value"]).decode()
        env = parse_user_data_env(user_data)
        disk = self.root / ec2_id
        if "AIBRO_CA_BUNDLE" in env:  # the CA bundle its bootstrap writes to /etc/aibro/ca.pem
            disk.mkdir(parents=True, exist_ok=True)
            (disk / "ca.pem").write_text(parse_user_data_ca(user_data) or "")
            env["AIBRO_CA_BUNDLE"] = str(disk / "ca.pem")
        for key in ("AIBRO_WORKER_TOKEN_FILE", "AIBRO_WORKER_DIR", "AIBRO_ENV_CACHE"):
            env[key] = str(disk / env[key].removeprefix("/var/lib/aibro/"))
        Path(env["AIBRO_WORKER_DIR"]).mkdir(parents=True, exist_ok=True)
        env["AIBRO_WORKER_URL"] = self.backend_url
        # never the test host's own shutdown: the played machine notes that it asked to be shut down
        env["AIBRO_SHUTDOWN_COMMAND"] = f"touch {disk / 'shutdown-requested'}"
        if self.machine_env is not None:
            env.update(self.machine_env(ec2_id))
        self.envs[ec2_id] = dict(env)
        base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        full = {**base, **self.aws_env, **env, "CUDA_VISIBLE_DEVICES": "-1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        log = open(disk / "agent.log", "ab")
        self.procs[ec2_id] = subprocess.Popen(
            [sys.executable, "-I", "-m", "aibro_backend.worker"],
            env=full,
            cwd=str(disk),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def _kill(self, ec2_id: str) -> None:
        import signal

        proc = self.procs.pop(ec2_id, None)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)

    def log(self, ec2_id: str) -> str:
        path = self.root / ec2_id / "agent.log"
        return path.read_text() if path.exists() else ""
