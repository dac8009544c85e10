"""The providers a backend runs besides the local one (`--provider aws|ray|ssh`), each loaded and checked against
its cloud, cluster or hosts before the backend listens. Each one's module is imported only when it is asked for:
boto3 and Ray are optional."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..providers import shipping
from ..settings import BackendSettings
from ..storage.s3blobs import S3Backing

if TYPE_CHECKING:
    from ..providers.aws import AwsProvider
    from ..providers.base import Provider
    from ..providers.ray import RayProvider
    from ..providers.ssh import SshProvider


@dataclass(frozen=True)
class ExtraProviders:
    """The loaded providers by kind: the composition reads what only one of them has (the AWS one's bucket) from
    its own typed field."""

    aws: AwsProvider | None = None
    ray: RayProvider | None = None
    ssh: SshProvider | None = None

    def s3_backing(self) -> S3Backing | None:
        """Where the AWS provider keeps bytes (its bucket and prefix); None without it: bytes stay on disk. Every job
        of such a backend, local ones included, then keeps its bytes in S3: one store, one backing."""
        if self.aws is None:
            return None
        config = self.aws.config
        return S3Backing(self.aws.session, config.s3_bucket, config.s3_prefix, config.region)

    def table(self) -> dict[str, Provider]:
        """The scheduler's providers by name, those loaded only."""
        named: dict[str, Provider | None] = {"aws": self.aws, "ray": self.ray, "ssh": self.ssh}
        return {name: provider for name, provider in named.items() if provider is not None}


def load_aws_provider(config_path: str, home: Path) -> AwsProvider:
    """The AWS provider from the config file, validated and checked against the account (every problem named in
    one AwsConfigError) before the backend listens; boto3 uses its usual credential chain."""
    from ..providers.aws_config import AwsConfigError, load_aws_config

    try:
        import boto3
    except ImportError:
        raise AwsConfigError(config_path, ['boto3 is not installed: pip install "aibro-backend[serve,aws]"']) from None
    from ..providers.aws import AwsProvider

    config = load_aws_config(config_path)
    session = boto3.Session(region_name=config.region)
    config = load_aws_config(config_path, session)
    return AwsProvider(config, session, agent=shipping.served(home))


RAY_FIX = (
    "start the cluster's head there (`ray start --head --port 6379`), or pass the address its head printed "
    "(`ray status` on a node shows it): --ray-address HOST:PORT"
)


def load_ray_provider(address: str, home: Path, worker_url: str | None, node_resource: str | None) -> RayProvider:
    """The Ray provider, connected to its cluster before the backend listens (Ray runs in the provider's bridge
    process, never in this one); a missing Ray or an unreachable cluster is a RayClusterError naming the address."""
    from ..providers.ray import RayClusterError, RayProvider, RayUnavailable

    settings = BackendSettings.from_env()
    try:
        provider = RayProvider(
            address,
            home / "state",
            backend_url=worker_url,
            node_resource=node_resource,
            sandbox_uid_base=settings.sandbox_uid_base,
        )
    except (RayUnavailable, ValueError) as exc:
        raise RayClusterError(address, str(exc)) from None
    timeout = settings.ray_connect_s
    if not provider.wait_ready(timeout):
        why = provider.cluster_error() or f"no answer from the Ray cluster at {address} within {timeout:g} s"
        provider.close()
        raise RayClusterError(address, f"{why}. Fix: {RAY_FIX}")
    return provider


def load_ssh_provider(hosts_file: str, home: Path, worker_url: str | None) -> SshProvider:
    """The SSH provider: its hosts file checked, then every host logged in to (its key recorded on first contact),
    before the backend listens; every problem is named in one HostsError."""
    from ..providers.ssh import SshProvider
    from ..providers.ssh_hosts import HostsError, load_hosts

    hosts = load_hosts(hosts_file)
    grace = BackendSettings.from_env().ssh_unreachable_s  # a host out of reach this long loses its jobs
    agent = shipping.served(home)
    provider = SshProvider(hosts, home / "state", agent, worker_url=worker_url, unreachable_grace_s=grace)
    problems = provider.check()
    if problems:
        provider.close()
        raise HostsError(hosts_file, problems)
    return provider
