"""The AWS provider's configuration: one file a user writes once, checked whole before anything is launched.

Format: TOML (read with the standard library's tomllib; comments allowed, which a file written once and read
months later needs). A file ending in `.json` is read as JSON with the same keys, for configs that other tools
generate. A flat table::

    region = "us-east-1"
    subnet_id = "subnet-0123456789abcdef0"
    security_group_ids = ["sg-0123456789abcdef0"]
    s3_bucket = "my-aibro-bucket"
    s3_prefix = "aibro/"                    # optional, default "aibro/"
    instance_profile = "aibro-worker"       # a name or an instance-profile ARN
    # instance_role_arn = "arn:aws:iam::123456789012:role/aibro-worker"   # optional: for the PassRole grant
    ami_ssm_parameter = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    # ami_id = "ami-0123456789abcdef0"      # exactly one of ami_id / ami_ssm_parameter
    backend_public_url = "https://aibro.example.com:8888"
    # key_name = "my-key"                   # optional: an EC2 key pair for SSH debugging
    # backend_id = "team-a"                 # optional: the aibro:backend tag value (default: the URL's host:port)
    # max_instance_hours = 12               # optional: an instance older than this is terminated (default 24)
    # max_instances_per_machine = 8         # optional: how many of one machine may run at once
    # agent_pip_spec = "aibro-backend"      # optional: what the instance pip-installs when its AMI lacks the agent
    [tags]                                  # optional: added to every instance and volume
    team = "ml"

`load_aws_config(path)` names every missing or wrong field in one error; `check_live(config, session)` then asks
EC2/S3/SSM whether the subnet, security groups, bucket and AMI exist. `least_policy(config)` is the IAM policy the
backend's own credentials need; `python -m aibro_backend.providers.aws_config policy FILE` prints it.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REQUIRED = (
    "region",
    "subnet_id",
    "security_group_ids",
    "s3_bucket",
    "instance_profile",
    "backend_public_url",
)
OPTIONAL = (
    "s3_prefix",
    "ami_id",
    "ami_ssm_parameter",
    "key_name",
    "tags",
    "max_instance_hours",
    "max_instances_per_machine",
    "backend_id",
    "instance_role_arn",
    "agent_pip_spec",
)
DEFAULT_PREFIX = "aibro/"
DEFAULT_MAX_HOURS = 24.0
MAX_HOURS_CAP = 24.0 * 14
DEFAULT_MAX_PER_MACHINE = 8
DEFAULT_AGENT_SPEC = "aibro-backend"
# aibro adds its own tags (aibro:* and Name); EC2 allows 50 per resource.
MAX_USER_TAGS = 40

_REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d{1,2}$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_SG = re.compile(r"^sg-[0-9a-f]{8,17}$")
_AMI = re.compile(r"^ami-[0-9a-f]{8,17}$")
_PROFILE_NAME = re.compile(r"^[\w+=,.@-]{1,128}$")
_PROFILE_ARN = re.compile(r"^arn:(aws[a-z-]*):iam::(\d{12}):instance-profile/(?:[\w+=,.@/-]*/)?([\w+=,.@-]{1,128})$")
_ROLE_ARN = re.compile(r"^arn:(aws[a-z-]*):iam::(\d{12}):role/(?:[\w+=,.@/-]*/)?([\w+=,.@-]{1,64})$")
_SSM_NAME = re.compile(r"^/?[a-zA-Z0-9_.\-/]{1,1011}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# What EC2 accepts in tag keys and values: letters, digits, spaces and + - = . _ : / @
_TAG_CHARS = re.compile(r"^[\w .:+=@/-]*$")
_KEY_NAME = re.compile(r"^[ -~]{1,255}$")


class AwsConfigError(ValueError):
    """Every problem of one config file, so the user fixes them in one pass."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"AWS config {source} has {len(self.problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class AwsConfig:
    region: str
    subnet_id: str
    security_group_ids: tuple[str, ...]
    s3_bucket: str
    instance_profile: str
    backend_public_url: str
    s3_prefix: str = DEFAULT_PREFIX
    ami_id: str | None = None
    ami_ssm_parameter: str | None = None
    key_name: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    max_instance_hours: float = DEFAULT_MAX_HOURS
    max_instances_per_machine: int = DEFAULT_MAX_PER_MACHINE
    backend_id: str = ""
    instance_role_arn: str | None = None
    agent_pip_spec: str = DEFAULT_AGENT_SPEC

    @property
    def partition(self) -> str:
        if self.region.startswith("cn-"):
            return "aws-cn"
        if self.region.startswith("us-gov-"):
            return "aws-us-gov"
        return "aws"

    @property
    def instance_profile_spec(self) -> dict[str, str]:
        """The IamInstanceProfile argument of run_instances."""
        if self.instance_profile.startswith("arn:"):
            return {"Arn": self.instance_profile}
        return {"Name": self.instance_profile}

    @property
    def instance_profile_name(self) -> str:
        m = _PROFILE_ARN.match(self.instance_profile)
        return m.group(3) if m else self.instance_profile


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value)


def validate(raw: Mapping[str, Any], source: str = "<config>") -> AwsConfig:
    """Check every field of a parsed config and build it; raise AwsConfigError naming all problems at once."""
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise AwsConfigError(source, ["the file must hold a table (key = value lines), not a list or a value"])
    known = set(REQUIRED) | set(OPTIONAL)
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"'{key}' is not a setting{hint}")
    for key in REQUIRED:
        if raw.get(key) in (None, "", [], ()):
            problems.append(f"'{key}' is missing")

    def text(key: str) -> str | None:
        value = raw.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            problems.append(f"'{key}' must be a string, got {type(value).__name__} {value!r}")
            return None
        return value.strip()

    region = text("region")
    if region and not _REGION.match(region):
        problems.append(f"'region' {region!r} is not an AWS region name (like 'us-east-1')")
    subnet = text("subnet_id")
    if subnet and not _SUBNET.match(subnet):
        problems.append(f"'subnet_id' {subnet!r} is not a subnet id (like 'subnet-0123456789abcdef0')")

    sgs_raw = raw.get("security_group_ids")
    sgs: tuple[str, ...] = ()
    if isinstance(sgs_raw, str):
        sgs_raw = [sgs_raw]
    if sgs_raw not in (None, [], ()):
        if not _is_str_list(sgs_raw):
            problems.append(f"'security_group_ids' must be a list of security group ids, got {sgs_raw!r}")
        else:
            sgs = tuple(s.strip() for s in sgs_raw)
            bad = [s for s in sgs if not _SG.match(s)]
            if bad:
                problems.append(f"'security_group_ids' holds {bad!r}, not security group ids (like 'sg-0123abcd')")
            if len(sgs) > 5:
                problems.append(f"'security_group_ids' lists {len(sgs)} groups; an instance takes at most 5")

    bucket = text("s3_bucket")
    if bucket:
        if bucket.startswith("s3://"):
            problems.append(f"'s3_bucket' {bucket!r} must be the bucket name alone (put the folder in 's3_prefix')")
        elif not _BUCKET.match(bucket) or ".." in bucket or _is_ip(bucket):
            problems.append(
                f"'s3_bucket' {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.', '-')"
            )
    prefix_raw = raw.get("s3_prefix", DEFAULT_PREFIX)
    prefix = DEFAULT_PREFIX
    if not isinstance(prefix_raw, str):
        problems.append(f"'s3_prefix' must be a string like 'aibro/', got {prefix_raw!r}")
    elif prefix_raw.strip().startswith("/") or "//" in prefix_raw or len(prefix_raw) > 512:
        problems.append(f"'s3_prefix' {prefix_raw!r} must be a relative key prefix like 'aibro/' (no leading '/')")
    else:
        prefix = prefix_raw.strip()
        if prefix and not prefix.endswith("/"):
            prefix += "/"

    profile = text("instance_profile")
    if profile and not (_PROFILE_ARN.match(profile) or (_PROFILE_NAME.match(profile) and ":" not in profile)):
        problems.append(
            f"'instance_profile' {profile!r} is neither an instance profile name nor its ARN "
            "(arn:aws:iam::<account>:instance-profile/<name>)"
        )
    role_arn = text("instance_role_arn")
    if role_arn and not _ROLE_ARN.match(role_arn):
        problems.append(f"'instance_role_arn' {role_arn!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")

    ami = text("ami_id")
    ssm = text("ami_ssm_parameter")
    if ami and ssm:
        problems.append("give one of 'ami_id' and 'ami_ssm_parameter', not both")
    elif not ami and not ssm:
        problems.append("'ami_id' or 'ami_ssm_parameter' is missing (the machine image the instances boot)")
    if ami and not _AMI.match(ami):
        problems.append(f"'ami_id' {ami!r} is not an AMI id (like 'ami-0123456789abcdef0')")
    if ssm and not _SSM_NAME.match(ssm):
        problems.append(f"'ami_ssm_parameter' {ssm!r} is not an SSM parameter name (like '/aws/service/.../ami-id')")

    url = text("backend_public_url")
    host_port = ""
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"'backend_public_url' {url!r} must be an http(s) URL the instances can reach")
        elif parts.username or parts.password or parts.query or parts.fragment:
            problems.append(f"'backend_public_url' {url!r} must not hold credentials, a query or a fragment")
        elif parts.hostname == "localhost" or _is_local_ip(parts.hostname):
            problems.append(f"'backend_public_url' {url!r} names this host; EC2 instances cannot reach it there")
        else:
            host_port = parts.netloc
        url = url.rstrip("/")

    key_name = text("key_name")
    if key_name and not _KEY_NAME.match(key_name):
        problems.append(f"'key_name' {key_name!r} is not a key pair name (printable ASCII, at most 255)")

    tags_raw = raw.get("tags", {})
    tags: dict[str, str] = {}
    if not isinstance(tags_raw, Mapping):
        problems.append(f"'tags' must be a table of key = \"value\" pairs, got {tags_raw!r}")
    else:
        for k, val in tags_raw.items():
            if not isinstance(val, str):
                problems.append(f"tag '{k}' must have a string value, got {val!r}")
            elif str(k).lower().startswith(("aws:", "aibro:")) or str(k) == "Name":
                problems.append(f"tag '{k}' is reserved (aws:*, aibro:* and Name are set by AWS and aibro)")
            elif not (
                0 < len(str(k)) <= 128 and len(val) <= 256 and _TAG_CHARS.match(str(k)) and _TAG_CHARS.match(val)
            ):
                problems.append(f"tag {k!r} = {val!r} is not a valid EC2 tag (key <= 128, value <= 256 characters)")
            else:
                tags[str(k)] = val
        if len(tags_raw) > MAX_USER_TAGS:
            problems.append(f"'tags' holds {len(tags_raw)} tags; at most {MAX_USER_TAGS} (aibro adds its own)")

    hours = _number(raw, "max_instance_hours", DEFAULT_MAX_HOURS, problems)
    if not 0 < hours <= MAX_HOURS_CAP:
        problems.append(f"'max_instance_hours' must be more than 0 and at most {MAX_HOURS_CAP:g}, got {hours:g}")
    per_machine = _number(raw, "max_instances_per_machine", DEFAULT_MAX_PER_MACHINE, problems)
    if per_machine != int(per_machine) or not 1 <= per_machine <= 1000:
        problems.append(f"'max_instances_per_machine' must be a whole number from 1 to 1000, got {per_machine:g}")

    backend_id = text("backend_id") or host_port
    if (
        "backend_id" in raw
        and backend_id
        and not (len(backend_id) <= 128 and _TAG_CHARS.match(backend_id) and not backend_id.lower().startswith("aws:"))
    ):
        problems.append(f"'backend_id' {backend_id!r} is not a valid tag value (letters, digits, + - = . _ : / @)")
    agent = text("agent_pip_spec") or DEFAULT_AGENT_SPEC
    if any(c in agent for c in "'\"\\`$\n;&|<>"):
        problems.append(f"'agent_pip_spec' {agent!r} must be a plain pip requirement or URL (no quotes or shell)")

    if problems:
        raise AwsConfigError(source, problems)
    assert region and subnet and bucket and profile and url  # all checked above
    return AwsConfig(
        region=region,
        subnet_id=subnet,
        security_group_ids=sgs,
        s3_bucket=bucket,
        s3_prefix=prefix,
        instance_profile=profile,
        backend_public_url=url,
        ami_id=ami,
        ami_ssm_parameter=ssm,
        key_name=key_name,
        tags=tags,
        max_instance_hours=float(hours),
        max_instances_per_machine=int(per_machine),
        backend_id=backend_id,
        instance_role_arn=role_arn,
        agent_pip_spec=agent,
    )


def _is_local_ip(name: str) -> bool:
    """A loopback or unspecified address: this host, which no EC2 instance reaches."""
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _number(raw: Mapping[str, Any], key: str, default: float, problems: list[str]) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        problems.append(f"'{key}' must be a number, got {value!r}")
        return default
    return float(value)


def parse_file(path: str | Path) -> dict[str, Any]:
    """Read the file as TOML (or JSON when it ends in .json); a syntax error names the file and the line."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise AwsConfigError(str(p), [f"cannot read the file: {exc.strerror or exc}"]) from None
    if p.suffix.lower() == ".json":
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise AwsConfigError(str(p), [f"not valid JSON: {exc}"]) from None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise AwsConfigError(
                str(p),
                [
                    "reading TOML needs Python >= 3.11 (or `pip install tomli`); "
                    "or write the same keys as JSON in a .json file"
                ],
            ) from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AwsConfigError(str(p), [f"not valid TOML: {exc}"]) from None


def load_aws_config(path: str | Path, session: Any | None = None) -> AwsConfig:
    """Parse and validate a config file; with a boto3 session, also check it against the account (check_live)."""
    config = validate(parse_file(path), str(path))
    if session is not None:
        problems = check_live(config, session)
        if problems:
            raise AwsConfigError(str(path), problems)
    return config


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", type(exc).__name__))


def resolve_ami(config: AwsConfig, ssm: Any) -> str:
    """The AMI id: the configured one, or the value of the configured SSM parameter (blocking)."""
    if config.ami_id:
        return config.ami_id
    value = ssm.get_parameter(Name=config.ami_ssm_parameter)["Parameter"]["Value"]
    if not _AMI.match(value or ""):
        raise ValueError(f"SSM parameter {config.ami_ssm_parameter} holds {value!r}, not an AMI id")
    return value


def check_live(config: AwsConfig, session: Any) -> list[str]:
    """Ask the account whether the config's resources exist; one problem per missing or mismatched one.

    Blocking (several API calls): run it at backend start, or off the IOLoop.
    """
    problems: list[str] = []
    ec2 = session.client("ec2", region_name=config.region)
    vpc = None
    try:
        subnets = ec2.describe_subnets(SubnetIds=[config.subnet_id])["Subnets"]
        vpc = subnets[0]["VpcId"] if subnets else None
    except Exception as exc:  # noqa: BLE001 - every failure becomes a line of the one report
        problems.append(f"subnet {config.subnet_id} not found in {config.region} ({_error_code(exc)})")
    try:
        groups = ec2.describe_security_groups(GroupIds=list(config.security_group_ids))["SecurityGroups"]
        other = [g["GroupId"] for g in groups if vpc and g.get("VpcId") != vpc]
        if other:
            problems.append(f"security groups {other} are not in the subnet's VPC {vpc}")
    except Exception as exc:  # noqa: BLE001
        problems.append(
            f"security groups {list(config.security_group_ids)} not all found in {config.region} ({_error_code(exc)})"
        )
    try:
        session.client("s3", region_name=config.region).head_bucket(Bucket=config.s3_bucket)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"S3 bucket {config.s3_bucket} is not reachable with these credentials ({_error_code(exc)})")
    ami = None
    try:
        ami = resolve_ami(config, session.client("ssm", region_name=config.region))
    except Exception as exc:  # noqa: BLE001
        problems.append(f"SSM parameter {config.ami_ssm_parameter} could not be read ({_error_code(exc)}: {exc})")
    if ami:
        try:
            if not ec2.describe_images(ImageIds=[ami])["Images"]:
                raise LookupError("no such image")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"AMI {ami} does not exist in {config.region} ({_error_code(exc)})")
    return problems


def least_policy(config: AwsConfig) -> dict[str, Any]:
    """The least IAM policy the backend's own credentials need to run this config (not the instances' role).

    Launching is allowed only with the aibro:backend tag of this backend, tagging only at launch, and
    start/stop/terminate only on instances that carry that tag; PassRole only for the instance role, to EC2.
    """
    part, region, backend = config.partition, config.region, config.backend_id
    ec2 = f"arn:{part}:ec2:{region}"
    tagged_kinds = [f"{ec2}:*:instance/*", f"{ec2}:*:volume/*", f"{ec2}:*:spot-instances-request/*"]
    image = f"{ec2}::image/{config.ami_id}" if config.ami_id else f"{ec2}::image/*"
    launch_on = [
        image,
        f"{ec2}:*:subnet/{config.subnet_id}",
        f"{ec2}:*:network-interface/*",
        *(f"{ec2}:*:security-group/{sg}" for sg in config.security_group_ids),
    ]
    if config.key_name:
        launch_on.append(f"{ec2}:*:key-pair/{config.key_name}")
    if config.instance_role_arn:
        role = config.instance_role_arn
    else:  # an instance profile made in the console holds the role of the same name
        m = _PROFILE_ARN.match(config.instance_profile)
        account = m.group(2) if m else "*"
        role = f"arn:{part}:iam::{account}:role/{config.instance_profile_name}"
    bucket = f"arn:{part}:s3:::{config.s3_bucket}"
    statements: list[dict[str, Any]] = [
        {
            "Sid": "AibroDescribe",
            "Effect": "Allow",
            "Action": [
                "ec2:DescribeInstances",
                "ec2:DescribeInstanceStatus",
                "ec2:DescribeSpotPriceHistory",
                "ec2:DescribeImages",
                "ec2:DescribeSubnets",
                "ec2:DescribeSecurityGroups",
            ],
            "Resource": "*",  # Describe* actions support no resource-level permissions
        },
        {
            "Sid": "AibroLaunchTaggedOnly",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": tagged_kinds,
            "Condition": {"StringEquals": {"aws:RequestTag/aibro:backend": backend}},
        },
        {
            "Sid": "AibroLaunchInto",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": launch_on,
        },
        {
            "Sid": "AibroTagAtLaunch",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": tagged_kinds,
            "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances"}},
        },
        {
            "Sid": "AibroManageOwnInstances",
            "Effect": "Allow",
            "Action": [
                "ec2:StartInstances",
                "ec2:StopInstances",
                "ec2:TerminateInstances",
                "ec2:CreateTags",  # renewing aibro:expires-at on a start
            ],
            "Resource": f"{ec2}:*:instance/*",
            "Condition": {"StringEquals": {"aws:ResourceTag/aibro:backend": backend}},
        },
        {
            "Sid": "AibroPassInstanceRole",
            "Effect": "Allow",
            "Action": "iam:PassRole",
            "Resource": role,
            "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
        },
        {
            "Sid": "AibroBucketList",
            "Effect": "Allow",
            "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
            "Resource": bucket,
            # IfExists: HeadBucket (the start-up check) sends no prefix
            "Condition": {"StringLikeIfExists": {"s3:prefix": [f"{config.s3_prefix}*"]}},
        },
        {
            "Sid": "AibroObjects",
            "Effect": "Allow",
            "Action": [
                "s3:GetObject",
                "s3:PutObject",
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
                "s3:ListMultipartUploadParts",
            ],
            "Resource": f"{bucket}/{config.s3_prefix}*",
        },
    ]
    if config.ami_ssm_parameter:
        name = config.ami_ssm_parameter if config.ami_ssm_parameter.startswith("/") else "/" + config.ami_ssm_parameter
        statements.append(
            {
                "Sid": "AibroReadAmiParameter",
                "Effect": "Allow",
                "Action": "ssm:GetParameter",
                # public parameters (/aws/service/...) have no account in their ARN; '*' also matches none
                "Resource": f"arn:{part}:ssm:{region}:*:parameter{name}",
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def main(argv: list[str] | None = None) -> int:
    """`policy FILE` prints the least IAM policy; `check FILE` validates the file and checks it live."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("policy", "check"):
        print("usage: python -m aibro_backend.providers.aws_config {policy|check} CONFIG", file=sys.stderr)
        return 2
    command, path = args
    try:
        if command == "policy":
            print(json.dumps(least_policy(load_aws_config(path)), indent=2))
        else:
            import boto3

            config = load_aws_config(path)
            load_aws_config(path, boto3.Session(region_name=config.region))
            print(f"{path}: OK (region {config.region}, backend_id {config.backend_id})")
    except AwsConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
