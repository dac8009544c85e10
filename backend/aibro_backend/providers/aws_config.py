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
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

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
)
DEFAULT_PREFIX = "aibro/"
DEFAULT_MAX_HOURS = 24.0
MAX_HOURS_CAP = 24.0 * 14
DEFAULT_MAX_PER_MACHINE = 8
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


def _text(key: str, rule: re.Pattern[str] | None = None, what: str = "") -> Any:
    """A stripped string field whose value must match `rule` (`what` says what it should look like)."""

    def check(value: str) -> str:
        value = value.strip()
        if rule is not None and not rule.match(value):
            raise ValueError(f"'{key}' {value!r} is not {what}")
        return value

    return AfterValidator(check)


Region = Annotated[str, _text("region", _REGION, "an AWS region name (like 'us-east-1')")]
SubnetId = Annotated[str, _text("subnet_id", _SUBNET, "a subnet id (like 'subnet-0123456789abcdef0')")]
AmiId = Annotated[str, _text("ami_id", _AMI, "an AMI id (like 'ami-0123456789abcdef0')")]
SsmName = Annotated[
    str, _text("ami_ssm_parameter", _SSM_NAME, "an SSM parameter name (like '/aws/service/.../ami-id')")
]
RoleArn = Annotated[str, _text("instance_role_arn", _ROLE_ARN, "an IAM role ARN (arn:aws:iam::<account>:role/<name>)")]
KeyName = Annotated[str, _text("key_name", _KEY_NAME, "a key pair name (printable ASCII, at most 255)")]
Text = Annotated[str, _text("")]


class AwsConfig(BaseModel):
    """The checked config; `validate` builds it from a parsed file and names every problem at once."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    region: Region
    subnet_id: SubnetId
    security_group_ids: tuple[str, ...]
    s3_bucket: Text
    instance_profile: Text
    backend_public_url: Text
    s3_prefix: str = DEFAULT_PREFIX
    ami_id: AmiId | None = None
    ami_ssm_parameter: SsmName | None = None
    key_name: KeyName | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    max_instance_hours: float = DEFAULT_MAX_HOURS
    max_instances_per_machine: int = DEFAULT_MAX_PER_MACHINE
    backend_id: str = ""
    instance_role_arn: RoleArn | None = None

    @field_validator("security_group_ids", mode="before")
    @classmethod
    def _groups(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"'security_group_ids' must be a list of security group ids, got {value!r}")
        groups = tuple(s.strip() for s in value)
        bad = [s for s in groups if not _SG.match(s)]
        if bad:
            raise ValueError(f"'security_group_ids' holds {bad!r}, not security group ids (like 'sg-0123abcd')")
        if len(groups) > 5:
            raise ValueError(f"'security_group_ids' lists {len(groups)} groups; an instance takes at most 5")
        return groups

    @field_validator("s3_bucket")
    @classmethod
    def _bucket(cls, bucket: str) -> str:
        if bucket.startswith("s3://"):
            raise ValueError(f"'s3_bucket' {bucket!r} must be the bucket name alone (put the folder in 's3_prefix')")
        if not _BUCKET.match(bucket) or ".." in bucket or _is_ip(bucket):
            raise ValueError(
                f"'s3_bucket' {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.', '-')"
            )
        return bucket

    @field_validator("s3_prefix", mode="before")
    @classmethod
    def _prefix(cls, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"'s3_prefix' must be a string like 'aibro/', got {value!r}")
        if value.strip().startswith("/") or "//" in value or len(value) > 512:
            raise ValueError(f"'s3_prefix' {value!r} must be a relative key prefix like 'aibro/' (no leading '/')")
        prefix = value.strip()
        return prefix + "/" if prefix and not prefix.endswith("/") else prefix

    @field_validator("instance_profile")
    @classmethod
    def _profile(cls, profile: str) -> str:
        if not (_PROFILE_ARN.match(profile) or (_PROFILE_NAME.match(profile) and ":" not in profile)):
            raise ValueError(
                f"'instance_profile' {profile!r} is neither an instance profile name nor its ARN "
                "(arn:aws:iam::<account>:instance-profile/<name>)"
            )
        return profile

    @field_validator("backend_public_url")
    @classmethod
    def _url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"'backend_public_url' {url!r} must be an http(s) URL the instances can reach")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError(f"'backend_public_url' {url!r} must not hold credentials, a query or a fragment")
        if parts.hostname == "localhost" or _is_local_ip(parts.hostname):
            raise ValueError(f"'backend_public_url' {url!r} names this host; EC2 instances cannot reach it there")
        return url.rstrip("/")

    @field_validator("tags", mode="before")
    @classmethod
    def _tags(cls, raw: Any) -> dict[str, str]:
        if not isinstance(raw, Mapping):
            raise ValueError(f"'tags' must be a table of key = \"value\" pairs, got {raw!r}")
        problems, tags = [], {}
        for k, val in raw.items():
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
        if len(raw) > MAX_USER_TAGS:
            problems.append(f"'tags' holds {len(raw)} tags; at most {MAX_USER_TAGS} (aibro adds its own)")
        if problems:
            raise ValueError(_SEVERAL.join(problems))
        return tags

    @field_validator("max_instance_hours", "max_instances_per_machine", mode="before")
    @classmethod
    def _number(cls, value: Any, info: ValidationInfo) -> float | int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"'{info.field_name}' must be a number, got {value!r}")
        if info.field_name == "max_instance_hours" and not 0 < value <= MAX_HOURS_CAP:
            raise ValueError(f"'max_instance_hours' must be more than 0 and at most {MAX_HOURS_CAP:g}, got {value:g}")
        if info.field_name == "max_instances_per_machine" and (value != int(value) or not 1 <= value <= 1000):
            raise ValueError(f"'max_instances_per_machine' must be a whole number from 1 to 1000, got {value:g}")
        return int(value) if info.field_name == "max_instances_per_machine" else float(value)

    @field_validator("backend_id")
    @classmethod
    def _backend_id(cls, value: str) -> str:
        value = value.strip()
        if value and not (len(value) <= 128 and _TAG_CHARS.match(value) and not value.lower().startswith("aws:")):
            raise ValueError(f"'backend_id' {value!r} is not a valid tag value (letters, digits, + - = . _ : / @)")
        return value

    @model_validator(mode="after")
    def _derived(self) -> AwsConfig:
        if not self.backend_id:  # the URL's host:port tags this backend's instances unless it is named
            object.__setattr__(self, "backend_id", urlsplit(self.backend_public_url).netloc)
        return self

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


_SEVERAL = "\n"  # one field's several problems (tags), split again into the list the user reads
KNOWN = tuple(AwsConfig.model_fields)


def validate(raw: Mapping[str, Any], source: str = "<config>") -> AwsConfig:
    """Check every field of a parsed config and build it; raise AwsConfigError naming all problems at once."""
    if not isinstance(raw, Mapping):
        raise AwsConfigError(source, ["the file must hold a table (key = value lines), not a list or a value"])
    given = {k: v for k, v in raw.items() if v not in (None, "", [], ())}  # an empty value is a missing one
    problems: list[str] = []
    if given.pop("agent_pip_spec", None) is not None:
        problems.append("'agent_pip_spec' is gone: the backend serves its own agent to its machines (drop the line)")
    if given.get("ami_id") and given.get("ami_ssm_parameter"):
        problems.append("give one of 'ami_id' and 'ami_ssm_parameter', not both")
    elif not given.get("ami_id") and not given.get("ami_ssm_parameter"):
        problems.append("'ami_id' or 'ami_ssm_parameter' is missing (the machine image the instances boot)")
    try:
        config = AwsConfig.model_validate(given)
    except ValidationError as exc:
        problems = [*_messages(exc), *problems]
    if problems:
        raise AwsConfigError(source, problems)
    return config


def _messages(exc: ValidationError) -> list[str]:
    """pydantic's errors in the words of this file: what is wrong and what it should be."""
    out: list[str] = []
    for error in exc.errors(include_url=False):
        key = str(error["loc"][0]) if error["loc"] else ""
        kind = error["type"]
        if kind == "missing":
            out.append(f"'{key}' is missing")
        elif kind == "extra_forbidden":
            close = difflib.get_close_matches(key, KNOWN, n=1)
            out.append(f"'{key}' is not a setting" + (f" (did you mean '{close[0]}'?)" if close else ""))
        elif kind == "value_error":
            out += str(error["ctx"]["error"]).split(_SEVERAL)
        else:
            value = error.get("input")
            out.append(f"'{key}' must be a string, got {type(value).__name__} {value!r}")
    return out


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
