"""moto's server mode for tests that run a real backend with the AWS provider: a ThreadedMotoServer on a free
port with fake credentials (nothing can reach a real account), the account a user sets up once (VPC, subnet,
security group, bucket, instance profile, SSM parameter naming the AMI), and a config file naming it."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
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


@contextmanager
def moto_server() -> Iterator[dict[str, str]]:
    """A moto server; yields the environment (fake credentials, AWS_ENDPOINT_URL) that points boto3 at it, also
    set in this process while it runs."""
    from moto.server import ThreadedMotoServer

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
