"""The AWS provider's building blocks against moto's server mode (a real HTTP endpoint, real boto3 calls):
catalog offers and live spot prices, config validation and the least IAM policy, launches (tags, ClientToken,
spot market options, user data), capacity errors and throttling injected at the boto3 boundary, stop/start,
reconcile and adopt, and a slow EC2 call that leaves an asyncio loop free."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import boto3  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask_cors  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402
from pydantic import ValidationError
from records import record

from aibro_backend.providers import aws_catalog  # noqa: E402
from aibro_backend.providers.aws import (  # noqa: E402
    CAPACITY_CODES,
    USER_DATA_LIMIT,
    AwsPoll,
    AwsProvider,
    CapacityError,
    LaunchError,
    format_expires,
    parse_user_data_env,
    tag_map,
)
from aibro_backend.providers.aws_config import (  # noqa: E402
    REQUIRED,
    AwsConfig,
    AwsConfigError,
    check_live,
    least_policy,
    load_aws_config,
    main,
    validate,
)
from aibro_backend.providers.base import LaunchRequest  # noqa: E402

pytestmark = pytest.mark.fast

REGION = "us-east-1"
ENROLL = "aibro_e_" + "x" * 40
WORKER_TOKEN = "aibro_w_secret-long-lived-token-0123456789"
LOCAL_OFFER_KEYS = {
    "machine_id",
    "provider",
    "gpu_type",
    "gpu_count",
    "vcpus",
    "memory_gib",
    "price_per_hour",
    "on_demand_price_per_hour",
    "spot",
    "capacity",
    "availability",
}


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """One moto server for the module; fake credentials, so nothing here can reach a real account."""
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(key, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = ThreadedMotoServer(port=0, verbose=False)
        server.start()
        _, port = server.get_host_and_port()
        url = f"http://localhost:{port}"
        mp.setenv("AWS_ENDPOINT_URL", url)
        try:
            yield url
        finally:
            server.stop()


@pytest.fixture(scope="module")
def account(moto_url: str) -> dict[str, Any]:
    """What a user sets up once: a VPC with a subnet and a security group, a bucket, an instance profile, and an
    SSM parameter naming the AMI."""
    session = boto3.Session(region_name=REGION)
    ec2 = session.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]
    sg = ec2.create_security_group(GroupName="aibro-workers", Description="aibro", VpcId=vpc)["GroupId"]
    other_vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    foreign_sg = ec2.create_security_group(GroupName="elsewhere", Description="x", VpcId=other_vpc)["GroupId"]
    ami = ec2.describe_images(Filters=[{"Name": "name", "Values": ["amzn2-ami-hvm-*"]}])["Images"][0]["ImageId"]
    session.client("s3").create_bucket(Bucket="aibro-test-bucket")
    iam = session.client("iam")
    iam.create_role(RoleName="aibro-worker", AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17"}))
    iam.create_instance_profile(InstanceProfileName="aibro-worker")
    iam.add_role_to_instance_profile(InstanceProfileName="aibro-worker", RoleName="aibro-worker")
    session.client("ssm").put_parameter(Name="/aibro/test/ami", Value=ami, Type="String")
    return {
        "session": session,
        "ec2": ec2,
        "subnet": subnet["SubnetId"],
        "zone": subnet["AvailabilityZone"],
        "sg": sg,
        "foreign_sg": foreign_sg,
        "ami": ami,
    }


def raw_config(account: dict[str, Any], **over: Any) -> dict[str, Any]:
    raw = {
        "region": REGION,
        "subnet_id": account["subnet"],
        "security_group_ids": [account["sg"]],
        "s3_bucket": "aibro-test-bucket",
        "s3_prefix": "jobs",
        "instance_profile": "aibro-worker",
        "ami_ssm_parameter": "/aibro/test/ami",
        "backend_public_url": "https://aibro.example.test:8888/",
        "backend_id": f"test-{uuid.uuid4().hex[:8]}",
        "tags": {"team": "ml"},
        "max_instance_hours": 2,
    }
    raw.update(over)
    return {k: val for k, val in raw.items() if val is not None}


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def provider(account: dict[str, Any], sleeps: list[float]) -> Iterator[AwsProvider]:
    """A provider with its own backend_id, so tests never see each other's instances; backoff sleeps recorded."""
    p = AwsProvider(validate(raw_config(account)), account["session"], sleep=sleeps.append)
    yield p
    p.close()


def env(instance_id: str) -> dict[str, str]:
    return {
        "AIBRO_WORKER_URL": "http://127.0.0.1:9999",
        "AIBRO_WORKER_TOKEN": WORKER_TOKEN,
        "AIBRO_INSTANCE_ID": instance_id,
        "AIBRO_ENROLL_TOKEN": ENROLL,
    }


def launched(p: AwsProvider, instance_id: str, machine_id: str, **kw: Any) -> str:
    p.launch(LaunchRequest(instance_id, machine_id, env(instance_id), user_id=kw.pop("user_id", 7), **kw))
    fut = p.launch_future(instance_id)
    assert fut is not None
    return fut.result(timeout=30)


def describe(ec2: Any, ec2_id: str) -> dict[str, Any]:
    return ec2.describe_instances(InstanceIds=[ec2_id])["Reservations"][0]["Instances"][0]


def tagged(ec2: Any, backend_id: str, states: tuple[str, ...] = ("pending", "running", "stopped")) -> list[dict]:
    out = ec2.describe_instances(
        Filters=[
            {"Name": "tag:aibro:backend", "Values": [backend_id]},
            {"Name": "instance-state-name", "Values": list(states)},
        ]
    )
    return [i for r in out["Reservations"] for i in r["Instances"]]


def client_error(code: str, op: str = "RunInstances") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, op)


# -- the marketplace -----------------------------------------------------------------------------------------
def test_catalog_offers_follow_the_seed_naming() -> None:
    assert aws_catalog.regions() == ["us-east-1", "us-west-2", "eu-west-1"]
    offers = {o.machine_id: o for o in aws_catalog.offers(REGION, {})}
    assert len(offers) == 2 * len(aws_catalog.instance_types(REGION)) == 24
    spot, od = offers["g4dn.xlarge"], offers["g4dn.xlarge.od"]
    assert LOCAL_OFFER_KEYS <= set(spot.model_dump()) and LOCAL_OFFER_KEYS <= set(od.model_dump())
    assert (spot.gpu_type, spot.gpu_count, spot.vcpus, spot.memory_gib) == ("T4", 1, 4, 16.0)
    assert spot.spot is True and od.spot is False
    assert od.price_per_hour == od.on_demand_price_per_hour == spot.on_demand_price_per_hour == 0.526
    assert od.price_source == "list"
    # no live price: an estimate, and marked as one
    assert spot.price_source == "estimate"
    assert spot.price_per_hour == round(0.526 * aws_catalog.SPOT_ESTIMATE_FRACTION, 4)
    assert offers["p4d.24xlarge"].gpu_count == 8
    assert aws_catalog.offers("ap-south-1", {}) == []
    assert aws_catalog.parse_machine_id("g5.xlarge.od") == ("g5.xlarge", False)
    assert aws_catalog.parse_machine_id("g5.xlarge") == ("g5.xlarge", True)


def test_latest_spot_price_per_zone_then_lowest_zone() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    history = [
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "a", "ProductDescription": "Linux/UNIX",
         "SpotPrice": "0.90", "Timestamp": t0},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "a", "ProductDescription": "Linux/UNIX",
         "SpotPrice": "0.40", "Timestamp": t0 + dt.timedelta(hours=1)},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "b", "ProductDescription": "Linux/UNIX (Amazon VPC)",
         "SpotPrice": "0.35", "Timestamp": t0},
        {"InstanceType": "g5.xlarge", "AvailabilityZone": "c", "ProductDescription": "Windows",
         "SpotPrice": "0.01", "Timestamp": t0 + dt.timedelta(hours=2)},
    ]  # fmt: skip
    assert aws_catalog.latest_spot_prices(history) == {"g5.xlarge": 0.35}
    assert aws_catalog.latest_spot_prices(history[:2]) == {"g5.xlarge": 0.40}


def test_offers_take_live_spot_prices_from_ec2(provider: AwsProvider) -> None:
    before = {o.machine_id: o for o in provider.offers()}  # returns at once; the refresh runs in the pool
    assert before["g4dn.xlarge"].price_source in ("estimate", "live")
    prices = provider.refresh_prices().result(timeout=30)
    assert prices["g4dn.xlarge"] == pytest.approx(0.00001)  # moto's fixed spot price history
    offers = {o.machine_id: o for o in provider.offers()}
    assert offers["g4dn.xlarge"].price_source == "live"
    assert offers["g4dn.xlarge"].price_per_hour == pytest.approx(0.00001)
    assert offers["g4dn.xlarge.od"].price_per_hour == 0.526
    # moto has no history for p3: still an estimate, still marked
    assert "p3.2xlarge" not in prices
    assert offers["p3.2xlarge"].price_source == "estimate"
    assert all(o.provider == "aws" and o.capacity == 8 for o in offers.values())


# -- the config ------------------------------------------------------------------------------------------------
def test_config_names_every_missing_field_at_once() -> None:
    with pytest.raises(AwsConfigError) as err:
        validate({})
    text = str(err.value)
    for key in REQUIRED:
        assert f"'{key}' is missing" in text
    assert "'ami_id' or 'ami_ssm_parameter' is missing" in text
    assert len(err.value.problems) == len(REQUIRED) + 1


def test_config_names_every_wrong_field_at_once() -> None:
    bad = {
        "region": "US East",
        "subnet_id": "sub-123",
        "security_group_ids": ["sg-zzz"],
        "s3_bucket": "s3://My_Bucket",
        "s3_prefix": "/abs",
        "instance_profile": "arn:aws:iam::12:role/x",
        "ami_id": "ami-0123456789abcdef0",
        "ami_ssm_parameter": "/x",
        "backend_public_url": "http://localhost:8888",
        "tags": {"aibro:job": "x", "ok": 3},
        "max_instance_hours": 0,
        "max_instances_per_machine": 2.5,
        "regoin": "us-east-1",
    }
    with pytest.raises(AwsConfigError) as err:
        validate(bad, "bad.toml")
    problems = err.value.problems
    for needle in (
        "'region'",
        "'subnet_id'",
        "'security_group_ids'",
        "'s3_bucket'",
        "'s3_prefix'",
        "'instance_profile'",
        "give one of 'ami_id' and 'ami_ssm_parameter', not both",
        "'backend_public_url'",
        "tag 'aibro:job' is reserved",
        "tag 'ok' must have a string value",
        "'max_instance_hours'",
        "'max_instances_per_machine'",
        "'regoin' is not a setting (did you mean 'region'?)",
    ):
        assert sum(p.startswith(needle) for p in problems) == 1, (needle, problems)
    assert len(problems) == 13
    assert str(err.value).startswith("AWS config bad.toml has 13 problem(s):")


def test_config_from_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "aws.toml"
    toml.write_text(
        """# written once
region = "eu-west-1"
subnet_id = "subnet-0123456789abcdef0"
security_group_ids = ["sg-0123456789abcdef0"]
s3_bucket = "my-aibro"
instance_profile = "arn:aws:iam::123456789012:instance-profile/aibro-worker"
ami_id = "ami-0123456789abcdef0"
backend_public_url = "https://aibro.example.com:8888"
[tags]
team = "ml"
"""
    )
    cfg = load_aws_config(toml)
    assert cfg.region == "eu-west-1" and cfg.s3_prefix == "aibro/" and cfg.max_instance_hours == 24
    assert cfg.backend_id == "aibro.example.com:8888"
    assert cfg.instance_profile_spec == {"Arn": "arn:aws:iam::123456789012:instance-profile/aibro-worker"}
    assert cfg.tags == {"team": "ml"}
    as_json = tmp_path / "aws.json"
    as_json.write_text(json.dumps({"region": "eu-west-1"}))
    with pytest.raises(AwsConfigError, match="'subnet_id' is missing"):
        load_aws_config(as_json)
    broken = tmp_path / "broken.toml"
    broken.write_text('region = "us-east-1\n')
    with pytest.raises(AwsConfigError, match="not valid TOML"):
        load_aws_config(broken)


def test_live_check_names_what_the_account_lacks(account: dict[str, Any]) -> None:
    session = account["session"]
    good = validate(raw_config(account))
    assert check_live(good, session) == []
    bad = validate(
        raw_config(
            account,
            subnet_id="subnet-0000000000000dead",
            security_group_ids=[account["foreign_sg"]],
            s3_bucket="no-such-aibro-bucket",
            ami_ssm_parameter="/aibro/missing",
        )
    )
    problems = check_live(bad, session)
    assert len(problems) == 3, problems  # the SG cannot be checked against a subnet that does not exist
    assert any("subnet subnet-0000000000000dead not found" in p for p in problems)
    assert any("no-such-aibro-bucket" in p for p in problems)
    assert any("/aibro/missing" in p and "ParameterNotFound" in p for p in problems)
    wrong_vpc = validate(raw_config(account, security_group_ids=[account["foreign_sg"]], ami_id="ami-00000000dead",
                                    ami_ssm_parameter=None))  # fmt: skip
    problems = check_live(wrong_vpc, session)
    assert any("not in the subnet's VPC" in p for p in problems)
    assert any("AMI ami-00000000dead does not exist" in p for p in problems)


def test_least_policy_is_scoped_to_this_backend(account: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    cfg = validate(raw_config(account, backend_id="team-a", key_name="dbg"))
    policy = least_policy(cfg)
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    actions = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert {
        "ec2:RunInstances",
        "ec2:DescribeInstances",
        "ec2:StartInstances",
        "ec2:StopInstances",
        "ec2:TerminateInstances",
        "ec2:CreateTags",
        "ec2:DescribeSpotPriceHistory",
        "iam:PassRole",
        "s3:GetObject",
        "s3:PutObject",
        "ssm:GetParameter",
    } <= actions
    assert not any(a.endswith(":*") or a == "*" for a in actions)
    assert by_sid["AibroLaunchTaggedOnly"]["Condition"] == {"StringEquals": {"aws:RequestTag/aibro:backend": "team-a"}}
    assert by_sid["AibroManageOwnInstances"]["Condition"] == {
        "StringEquals": {"aws:ResourceTag/aibro:backend": "team-a"}
    }
    assert by_sid["AibroTagAtLaunch"]["Condition"] == {"StringEquals": {"ec2:CreateAction": "RunInstances"}}
    assert by_sid["AibroPassInstanceRole"]["Resource"] == "arn:aws:iam::*:role/aibro-worker"
    assert by_sid["AibroPassInstanceRole"]["Condition"]["StringEquals"]["iam:PassedToService"] == "ec2.amazonaws.com"
    assert by_sid["AibroObjects"]["Resource"] == "arn:aws:s3:::aibro-test-bucket/jobs/*"
    assert by_sid["AibroReadAmiParameter"]["Resource"] == "arn:aws:ssm:us-east-1:*:parameter/aibro/test/ami"
    launch_into = by_sid["AibroLaunchInto"]["Resource"]
    assert f"arn:aws:ec2:us-east-1:*:subnet/{account['subnet']}" in launch_into
    assert f"arn:aws:ec2:us-east-1:*:security-group/{account['sg']}" in launch_into
    assert "arn:aws:ec2:us-east-1:*:key-pair/dbg" in launch_into
    # the CLI prints the same document
    path = tmp_path / "aws.json"
    path.write_text(json.dumps(raw_config(account, backend_id="team-a", key_name="dbg")))
    assert main(["policy", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == policy
    assert main(["policy", str(tmp_path / "missing.toml")]) == 1
    assert "cannot read the file" in capsys.readouterr().err


# -- launching -------------------------------------------------------------------------------------------------
def test_launch_tags_market_options_and_user_data(provider: AwsProvider, account: dict[str, Any]) -> None:
    ec2 = account["ec2"]
    provider.launch(LaunchRequest("inst-spot1", "g4dn.xlarge", env("inst-spot1"), user_id=7, job_id="job-1"))
    assert provider.alive(record("inst-spot1"))  # in flight counts as alive
    spot_id = provider.launch_future("inst-spot1").result(timeout=30)
    od_id = launched(provider, "inst-od1", "g4dn.xlarge.od")
    spot, od = describe(ec2, spot_id), describe(ec2, od_id)

    tags = tag_map(spot)
    assert tags["aibro:backend"] == provider.config.backend_id
    assert (tags["aibro:instance"], tags["aibro:machine"], tags["aibro:user"], tags["aibro:job"]) == (
        "inst-spot1",
        "g4dn.xlarge",
        "7",
        "job-1",
    )
    assert tags["team"] == "ml" and tags["Name"].startswith("aibro inst-spot1")
    expires = dt.datetime.strptime(tags["aibro:expires-at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert abs(expires.timestamp() - (time.time() + 2 * 3600)) < 120
    assert "aibro:job" not in tag_map(od)

    assert spot["InstanceType"] == od["InstanceType"] == "g4dn.xlarge"
    assert spot.get("InstanceLifecycle") == "spot" and "InstanceLifecycle" not in od
    assert spot["ImageId"] == account["ami"]  # resolved through SSM
    assert spot["SubnetId"] == account["subnet"]
    assert spot["MetadataOptions"]["HttpTokens"] == "required"
    assert spot["IamInstanceProfile"]["Arn"].endswith("instance-profile/aibro-worker")
    assert spot["ClientToken"] == provider.client_token("inst-spot1")
    assert od["ClientToken"] == provider.client_token("inst-od1") != spot["ClientToken"]

    def shutdown(i: str) -> str:
        return ec2.describe_instance_attribute(InstanceId=i, Attribute="instanceInitiatedShutdownBehavior")[
            "InstanceInitiatedShutdownBehavior"
        ]["Value"]

    assert shutdown(spot_id) == "terminate" and shutdown(od_id) == "stop"

    raw = ec2.describe_instance_attribute(InstanceId=spot_id, Attribute="userData")["UserData"]["Value"]
    user_data = base64.b64decode(raw).decode()
    assert len(user_data.encode()) < USER_DATA_LIMIT
    assert ENROLL in user_data and WORKER_TOKEN not in user_data and "127.0.0.1" not in user_data
    assert "systemctl enable --now aibro-worker.service" in user_data
    assert parse_user_data_env(user_data) == {
        "AIBRO_WORKER_URL": "https://aibro.example.test:8888",
        "AIBRO_INSTANCE_ID": "inst-spot1",
        "AIBRO_ENROLL_TOKEN": ENROLL,
        "AIBRO_WORKER_TOKEN_FILE": "/var/lib/aibro/worker-token",
        "AIBRO_WORKER_DIR": "/var/lib/aibro/work",
        "AIBRO_ENV_CACHE": "/var/lib/aibro/envs",
        "AIBRO_SHUTDOWN_ON_LOSS": "1",
        "AIBRO_SPOT_WATCH": "1",  # a spot machine's agent polls IMDS for the interruption notice
    }
    od_data = ec2.describe_instance_attribute(InstanceId=od_id, Attribute="userData")["UserData"]["Value"]
    assert "AIBRO_SPOT_WATCH" not in parse_user_data_env(base64.b64decode(od_data).decode())
    snap = provider.poll("inst-spot1")
    assert snap is not None and snap.ec2_instance_id == spot_id and snap.state in ("pending", "running")


def test_launch_refuses_bad_input_before_any_call(provider: AwsProvider) -> None:
    with pytest.raises(ValueError, match="not an AWS machine offered in us-east-1"):
        provider.launch(LaunchRequest("inst-x", "local-cpu", env("inst-x")))
    with pytest.raises(ValueError, match="AIBRO_ENROLL_TOKEN"):
        provider.launch(LaunchRequest("inst-x", "g4dn.xlarge", {"AIBRO_WORKER_TOKEN": WORKER_TOKEN}))
    with pytest.raises(ValueError, match="instance id"):
        provider.launch(LaunchRequest("inst x; rm -rf /", "g4dn.xlarge", env("inst-x")))
    assert provider.poll("inst-x") is None


def test_same_instance_launched_twice_is_one_instance(provider: AwsProvider, account: dict[str, Any]) -> None:
    first = launched(provider, "inst-twice", "g5.xlarge.od")
    provider.launch(LaunchRequest("inst-twice", "g5.xlarge.od", env("inst-twice")))
    assert provider.launch_future("inst-twice").result(timeout=30) == first
    assert [i["InstanceId"] for i in tagged(account["ec2"], provider.config.backend_id)] == [first]


def test_retry_after_an_ambiguous_failure_launches_once(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    """The request reached EC2 but the answer was lost: the retry carries the same ClientToken and first looks
    the instance up by its tag (moto does not honour ClientToken, so this is what keeps it to one instance)."""
    real = provider.ec2_launch.run_instances
    tokens: list[str] = []

    def lost_answer(**kwargs: Any) -> Any:
        tokens.append(kwargs["ClientToken"])
        out = real(**kwargs)
        if len(tokens) == 1:
            raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com")
        return out

    monkeypatch.setattr(provider.ec2_launch, "run_instances", lost_answer)
    ec2_id = launched(provider, "inst-lost", "g4dn.2xlarge.od")
    assert tokens == [provider.client_token("inst-lost")]  # found by tag; no second run_instances
    assert [i["InstanceId"] for i in tagged(account["ec2"], provider.config.backend_id)] == [ec2_id]
    assert len(sleeps) == 1


@pytest.mark.parametrize("code", sorted(CAPACITY_CODES))
def test_capacity_errors_fail_fast_as_capacity_error(
    provider: AwsProvider, monkeypatch: pytest.MonkeyPatch, sleeps: list[float], code: str
) -> None:
    calls: list[dict[str, Any]] = []

    def no_room(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise client_error(code)

    monkeypatch.setattr(provider.ec2_launch, "run_instances", no_room)
    provider.launch(LaunchRequest("inst-full", "g5.12xlarge", env("inst-full")))
    with pytest.raises(CapacityError) as err:
        provider.launch_future("inst-full").result(timeout=30)
    assert err.value.code == code and err.value.machine_id == "g5.12xlarge"
    assert len(calls) == 1 and sleeps == []  # not retried: the scheduler moves on to the next machine at once
    assert provider.launch_error("inst-full") is err.value
    assert provider.poll("inst-full").capacity_error is True
    assert not provider.alive(record("inst-full"))


def test_throttling_backs_off_then_succeeds(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    real = provider.ec2_launch.run_instances
    calls: list[str] = []

    def throttled(**kwargs: Any) -> Any:
        calls.append(kwargs["ClientToken"])
        if len(calls) <= 2:
            raise client_error("RequestLimitExceeded" if len(calls) == 1 else "Throttling")
        return real(**kwargs)

    monkeypatch.setattr(provider.ec2_launch, "run_instances", throttled)
    ec2_id = launched(provider, "inst-throttled", "g6.xlarge")
    assert len(calls) == 3 and len(set(calls)) == 1  # one attempt, one token
    assert len(sleeps) == 2 and all(0 <= s <= provider.backoff_base_s * 2**n for n, s in enumerate(sleeps))
    assert [i["InstanceId"] for i in tagged(account["ec2"], provider.config.backend_id)] == [ec2_id]


def test_throttling_gives_up_after_bounded_retries(
    provider: AwsProvider, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    calls: list[int] = []

    def always(**kwargs: Any) -> Any:
        calls.append(1)
        raise client_error("RequestLimitExceeded")

    monkeypatch.setattr(provider.ec2_launch, "run_instances", always)
    provider.launch(LaunchRequest("inst-never", "g6.xlarge", env("inst-never")))
    with pytest.raises(LaunchError, match="RequestLimitExceeded"):
        provider.launch_future("inst-never").result(timeout=30)
    assert len(calls) == provider.max_retries + 1 and len(sleeps) == provider.max_retries
    assert all(s <= provider.backoff_cap_s for s in sleeps)


def test_botocore_retries_every_call_but_the_two_whose_capacity_errors_must_fail_fast(provider: AwsProvider) -> None:
    """EC2 answers InsufficientInstanceCapacity with a 500, which botocore's retry modes retry: run_instances and
    start_instances go through a client with botocore's retries off (retried above on throttling only)."""
    assert provider.ec2.meta.config.retries == {"mode": "standard", "total_max_attempts": provider.max_retries + 1}
    assert provider.ssm.meta.config.retries == provider.ec2.meta.config.retries
    assert provider.ec2_launch.meta.config.retries["total_max_attempts"] == 1  # one try: no retry


def test_other_launch_errors_are_not_capacity(provider: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(**kwargs: Any) -> Any:
        raise client_error("UnauthorizedOperation")

    monkeypatch.setattr(provider.ec2_launch, "run_instances", denied)
    provider.launch(LaunchRequest("inst-denied", "g6.xlarge", env("inst-denied")))
    err = provider.launch_future("inst-denied").exception(timeout=30)
    assert isinstance(err, LaunchError) and not isinstance(err, CapacityError)
    assert err.code == "UnauthorizedOperation"


# -- stop / start, terminate, reconcile, adopt -------------------------------------------------------------------
def test_stop_and_start_an_on_demand_instance(provider: AwsProvider, account: dict[str, Any]) -> None:
    ec2 = account["ec2"]
    ec2_id = launched(provider, "inst-warm", "g4dn.xlarge.od")
    inst = record("inst-warm", "g4dn.xlarge.od")
    provider.stop(inst).result(timeout=30)
    assert describe(ec2, ec2_id)["State"]["Name"] == "stopped"
    provider.refresh().result(timeout=30)
    assert provider.poll("inst-warm").state == "stopped"
    assert provider.alive(inst)  # stopped on purpose: kept for a fast restart
    ec2.create_tags(Resources=[ec2_id], Tags=[{"Key": "aibro:expires-at", "Value": format_expires(time.time() + 60)}])
    provider.start(inst).result(timeout=30)
    started = describe(ec2, ec2_id)
    assert started["State"]["Name"] == "running"
    renewed = dt.datetime.strptime(tag_map(started)["aibro:expires-at"], "%Y-%m-%dT%H:%M:%SZ")
    assert renewed.replace(tzinfo=dt.timezone.utc).timestamp() > time.time() + 3600  # renewed on start

    # ops on one instance run in order: a start asked for right after a stop runs after it
    provider.stop(inst)
    provider.start(inst).result(timeout=30)
    assert describe(ec2, ec2_id)["State"]["Name"] == "running"

    launched(provider, "inst-spot2", "g4dn.xlarge")
    with pytest.raises(ValueError, match="spot"):
        provider.stop(record("inst-spot2", "g4dn.xlarge"))


def test_start_with_no_capacity_is_a_capacity_error(provider: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    launched(provider, "inst-nostart", "g5.xlarge.od")
    inst = record("inst-nostart", "g5.xlarge.od")
    provider.stop(inst).result(timeout=30)

    def no_room(**kwargs: Any) -> Any:
        raise client_error("InsufficientInstanceCapacity", "StartInstances")

    monkeypatch.setattr(provider.ec2_launch, "start_instances", no_room)
    with pytest.raises(CapacityError):
        provider.start(inst).result(timeout=30)


def test_terminate_and_lost_instances_are_not_alive(provider: AwsProvider, account: dict[str, Any]) -> None:
    ec2 = account["ec2"]
    a = launched(provider, "inst-a", "g4dn.xlarge")
    b = launched(provider, "inst-b", "g4dn.xlarge.od")
    first = provider.terminate(record("inst-a"))
    assert provider.terminate(record("inst-a")) is first or first.done()  # one request, shared
    first.result(timeout=30)
    assert not provider.alive(record("inst-a"))
    assert describe(ec2, a)["State"]["Name"] in ("shutting-down", "terminated")
    # lost behind our back (a spot interruption, a console click): the next listing says so
    ec2.terminate_instances(InstanceIds=[b])
    assert provider.alive(record("inst-b"))
    provider.refresh().result(timeout=30)
    assert not provider.alive(record("inst-b"))
    # an on-demand instance that stopped itself (its agent lost the backend) is not a live worker either
    c = launched(provider, "inst-c", "g5.xlarge.od")
    ec2.stop_instances(InstanceIds=[c])
    provider.refresh().result(timeout=30)
    assert not provider.alive(record("inst-c"))


def test_terminate_while_the_launch_is_in_flight(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = provider.ec2_launch.run_instances

    def slow(**kwargs: Any) -> Any:
        time.sleep(0.5)
        return real(**kwargs)

    monkeypatch.setattr(provider.ec2_launch, "run_instances", slow)
    provider.launch(LaunchRequest("inst-early", "g4dn.xlarge", env("inst-early")))
    provider.terminate(record("inst-early")).result(timeout=30)
    assert tagged(account["ec2"], provider.config.backend_id) == []
    assert not provider.alive(record("inst-early"))


def test_reconcile_terminates_unknown_and_expired(provider: AwsProvider, account: dict[str, Any]) -> None:
    ec2 = account["ec2"]
    keep = launched(provider, "inst-keep", "g4dn.xlarge.od")
    stray = launched(provider, "inst-stray", "g4dn.xlarge")
    old = launched(provider, "inst-old", "g5.xlarge.od")
    ec2.create_tags(Resources=[old], Tags=[{"Key": "aibro:expires-at", "Value": format_expires(time.time() - 1)}])
    # another backend's instance in the same account is none of our business
    other = AwsProvider(validate(raw_config(account)), account["session"])
    try:
        theirs = launched(other, "inst-theirs", "g4dn.xlarge")
        terminated = provider.reconcile({"inst-keep", "inst-old"}).result(timeout=30)
    finally:
        other.close()
    assert sorted(terminated) == sorted([stray, old])
    assert describe(ec2, keep)["State"]["Name"] == "running"
    assert describe(ec2, theirs)["State"]["Name"] == "running"
    for gone in (stray, old):
        assert describe(ec2, gone)["State"]["Name"] in ("shutting-down", "terminated")
    assert not provider.alive(record("inst-old"))
    assert provider.reconcile({"inst-keep"}).result(timeout=30) == []


def test_reconcile_spares_a_launch_newer_than_its_snapshot(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's ids were read before reconcile() was called; an instance launched after that (and listed by
    the reconciler's describe_instances) is not in them, yet must not be taken for a stray."""
    real = provider.ec2.describe_instances
    gate = threading.Event()

    def held(**kwargs: Any) -> Any:
        assert gate.wait(timeout=30)
        return real(**kwargs)

    monkeypatch.setattr(provider.ec2, "describe_instances", held)
    fut = provider.reconcile(set())
    ec2_id = launched(provider, "inst-new", "g4dn.xlarge.od")
    gate.set()  # the listing runs now, after the launch
    assert fut.result(timeout=30) == []
    assert describe(account["ec2"], ec2_id)["State"]["Name"] == "running"
    assert provider.reconcile(set()).result(timeout=30) == [ec2_id]  # a later snapshot without it: a stray


def test_a_listing_begun_before_a_start_does_not_undo_it(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's periodic listing saw a machine stopped; a restart landed before the listing was applied: the
    restarted machine stays alive (the scheduler would otherwise take it for lost and launch another)."""
    ec2_id = launched(provider, "inst-back", "g5.xlarge.od")
    provider.stop(record("inst-back")).result(timeout=30)
    provider.refresh().result(timeout=30)
    assert provider.alive(record("inst-back")), "stopped by us: still ours"
    real = provider.ec2.describe_instances
    listed, gate = threading.Event(), threading.Event()

    def listed_then_held(**kwargs: Any) -> Any:
        out = real(**kwargs)
        listed.set()
        assert gate.wait(timeout=30)
        return out

    monkeypatch.setattr(provider.ec2, "describe_instances", listed_then_held)
    listing = provider.refresh()
    assert listed.wait(timeout=30), "the listing has seen the machine stopped"
    monkeypatch.setattr(provider.ec2, "describe_instances", real)
    provider.start(record("inst-back")).result(timeout=30)
    gate.set()
    listing.result(timeout=30)
    assert provider.alive(record("inst-back")), "the older listing did not undo the start"
    assert describe(account["ec2"], ec2_id)["State"]["Name"] in ("pending", "running")
    provider.refresh().result(timeout=30)  # a listing begun after the start is news again
    assert provider.alive(record("inst-back"))


def test_adopt_after_a_restart(provider: AwsProvider, account: dict[str, Any]) -> None:
    a = launched(provider, "inst-live1", "g4dn.xlarge", user_id=3, job_id="job-9")
    b = launched(provider, "inst-live2", "g5.xlarge.od", user_id=4)
    provider.stop(record("inst-live2")).result(timeout=30)
    gone = launched(provider, "inst-dead", "g6.xlarge")
    account["ec2"].terminate_instances(InstanceIds=[gone])

    restarted = AwsProvider(provider.config, account["session"])  # a new backend process, same config
    try:
        assert restarted.alive(record("inst-live1"))  # not listed yet: alive until a listing says otherwise
        adopted = {d.instance_id: d for d in restarted.adopt().result(timeout=30)}
        assert set(adopted) == {"inst-live1", "inst-live2"}
        assert dataclasses.replace(adopted["inst-live1"], launched_at=None, expires_at=None) == AwsPoll(
            instance_id="inst-live1",
            ec2_instance_id=a,
            machine_id="g4dn.xlarge",
            spot=True,
            state="running",
            user_id=3,
            job_id="job-9",
            launched_at=None,
            expires_at=None,
            error=None,
            capacity_error=False,
        )
        assert adopted["inst-live2"].state == "stopped" and adopted["inst-live2"].ec2_instance_id == b
        assert adopted["inst-live1"].expires_at > time.time()
        assert restarted.alive(record("inst-live1")) and restarted.alive(record("inst-live2"))
        assert not restarted.alive(record("inst-dead"))
        restarted.start(record("inst-live2")).result(timeout=30)
        assert describe(account["ec2"], b)["State"]["Name"] == "running"
    finally:
        restarted.close()


# -- the IOLoop stays free ------------------------------------------------------------------------------------------
def test_a_slow_ec2_call_does_not_block_the_event_loop(
    provider: AwsProvider, account: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_instances is held inside EC2 until the test lets it go. The scheduler's synchronous calls (launch, reap,
    alive, offers) and a coroutine on the loop must all finish while it is held: if any of them waited on EC2, the
    held call would run out its 60 s and fail the launch instead. Ordering, not timing: a loaded box cannot make
    this fail, a blocking provider always does."""
    real = provider.ec2_launch.run_instances
    entered, release = threading.Event(), threading.Event()

    def held(**kwargs: Any) -> Any:
        entered.set()
        if not release.wait(60):
            raise AssertionError("run_instances was waited on: the caller blocked until EC2 answered")
        return real(**kwargs)

    monkeypatch.setattr(provider.ec2_launch, "run_instances", held)

    async def scenario() -> str:
        provider.launch(LaunchRequest("inst-slow", "g4dn.xlarge.od", env("inst-slow")))  # as the scheduler's tick
        provider.reap()
        assert provider.alive(record("inst-slow"))
        assert provider.offers()
        assert await asyncio.to_thread(entered.wait, 60), "run_instances was never called"
        await asyncio.sleep(0)  # the loop itself turns while EC2 holds the call
        release.set()
        fut: Future = provider.launch_future("inst-slow")
        return await asyncio.wrap_future(fut)

    ec2_id = asyncio.run(scenario())
    assert describe(account["ec2"], ec2_id)["State"]["Name"] == "running"


def test_config_type_is_frozen(account: dict[str, Any]) -> None:
    cfg = validate(raw_config(account))
    assert isinstance(cfg, AwsConfig)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.region = "eu-west-1"  # type: ignore[misc]


def test_user_data_installs_the_agent_the_backend_serves_by_its_hash(account: dict[str, Any], tmp_path: Path) -> None:
    """Issue 26: never `pip install aibro-backend` (a name nobody publishes, that anyone could take): the machine
    downloads the backend's own wheel, keeps it only if its SHA-256 is the one named here, and installs that file."""
    from aibro_backend.providers import shipping
    from aibro_backend.providers.aws import build_user_data

    agent = shipping.build(tmp_path)
    script = build_user_data(validate(raw_config(account)), "inst-1", "aibro_e_" + "x" * 32, agent)
    assert agent.sha256 in script and f'!= "{agent.version}"' in script and 'd="/opt/aibro"' in script
    installs = [line.strip() for line in script.splitlines() if "pip install" in line]
    assert installs == [
        f'"$d/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$d/{agent.filename}" $pin'
    ]
    pinned = build_user_data(validate(raw_config(account)), "inst-1", "aibro_e_" + "x" * 32, agent, tensorflow="2.20")
    assert 'find_spec(\'tensorflow\') is None)" || pin="tensorflow~=2.20.0"' in pinned, "no TensorFlow: the kernel's"
    assert 'pin=""' in script and "tensorflow~=" not in script, "without the job's version nothing is pinned"
    assert "aibro-backend" not in script.replace(agent.filename, ""), "no agent by a package name"
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    download = script.split("<<'AIBRO_GET'\n", 1)[1].split("AIBRO_GET\n", 1)[0]
    compile(download, "agent-download", "exec")


def test_the_old_agent_pip_spec_setting_is_refused_naming_why(account: dict[str, Any]) -> None:
    with pytest.raises(AwsConfigError, match="'agent_pip_spec' is gone: the backend serves its own agent"):
        validate(raw_config(account, agent_pip_spec="aibro-backend"))
