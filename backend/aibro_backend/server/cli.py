"""`python -m aibro_backend` (and `aibro-backend`): the command line parsed and checked, every AIBRO_* setting
checked, the asked-for providers loaded, then the backend served on the event loop (service.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aibro_core.envsettings import SettingsError
from aibro_core.serveflags import add_serve_flags

from ..settings import BackendSettings
from .accesslog import RedactingFormatter
from .loaders import ExtraProviders, load_aws_provider, load_ray_provider, load_ssh_provider
from .service import serve
from .tls import is_loopback, plain_http_warning, tls_context


def settings_problems() -> list[str]:
    """Every wrong AIBRO_* setting (policy, service limits, job limits, providers), named at once before anything
    starts."""
    try:
        BackendSettings.from_env()
    except SettingsError as exc:
        return [str(exc)]
    return []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aibro-backend", description="Run the aibro training backend.")
    parser.add_argument("--home", help="the backend's folder (default: AIBRO_HOME, else ~/.aibro)")
    add_serve_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.umask(0o077)  # everything the backend writes (database, WAL, logs, blobs, artifacts) is private to its user
    parser = build_parser()
    args = parser.parse_args(argv)
    args.provider = args.provider or []
    ray_opts = args.ray_address or args.ray_worker_url or args.ray_node_resource
    if "ray" in args.provider and not args.ray_address:
        parser.error("--provider ray needs --ray-address HOST:PORT (the address `ray start --head` printed)")
    if ray_opts and "ray" not in args.provider:
        parser.error("--ray-address, --ray-worker-url and --ray-node-resource go with --provider ray")
    if "aws" in args.provider and not args.aws_config:
        parser.error("--provider aws needs --aws-config FILE (region, subnet, security groups, bucket, ...)")
    if args.aws_config and "aws" not in args.provider:
        parser.error("--aws-config goes with --provider aws")
    if "ssh" in args.provider and not args.ssh_hosts:
        parser.error("--provider ssh needs --ssh-hosts FILE (one [[host]] table per machine: name, host, user, ...)")
    if (args.ssh_hosts or args.ssh_worker_url) and "ssh" not in args.provider:
        parser.error("--ssh-hosts and --ssh-worker-url go with --provider ssh")
    problems = settings_problems()
    if problems:
        print("aibro backend: " + "\n  ".join(problems), file=sys.stderr, flush=True)
        sys.exit(2)
    settings = BackendSettings.from_env()
    args.home = args.home or str(settings.home)
    args.ca_bundle = args.ca_bundle or settings.ca_bundle
    args.sandbox = args.sandbox or settings.sandbox
    os.environ[BackendSettings.variable("sandbox")] = args.sandbox  # the local provider reads it (sandbox.py)
    for stream in (sys.stdout, sys.stderr):  # the daemon's log file shows what happened, as it happens
        getattr(stream, "reconfigure", lambda **_: None)(line_buffering=True)
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("tornado.access").setLevel(logging.WARNING)  # errors only: workers poll several times a second
    try:
        tls = tls_context(args.certfile, args.keyfile)
    except (OSError, ssl.SSLError) as exc:
        parser.error(f"cannot load the TLS certificate/key: {exc}")
    if args.ca_bundle:  # local workers get a copy, cloud machines the PEM in their user data (AIBRO_CA_BUNDLE)
        try:
            ssl.create_default_context(cafile=args.ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            parser.error(f"--ca-bundle {args.ca_bundle}: not a readable PEM CA bundle ({exc})")
        os.environ[BackendSettings.variable("ca_bundle")] = os.path.abspath(args.ca_bundle)
    if tls is None and not is_loopback(args.host):
        print(plain_http_warning(args.host), file=sys.stderr, flush=True)
    aws = ray = ssh = None
    if args.aws_config:
        from ..providers.aws_config import AwsConfigError

        try:
            aws = load_aws_provider(args.aws_config, Path(args.home))
        except AwsConfigError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    if args.ray_address:
        from ..providers.ray import RayClusterError

        try:
            ray = load_ray_provider(args.ray_address, Path(args.home), args.ray_worker_url, args.ray_node_resource)
        except RayClusterError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    if args.ssh_hosts:
        from ..providers.ssh_hosts import HostsError

        try:
            ssh = load_ssh_provider(args.ssh_hosts, Path(args.home), args.ssh_worker_url)
        except HostsError as exc:
            print(f"aibro backend: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    run_loop(serve(Path(args.home), args.host, args.port, tls, ExtraProviders(aws, ray, ssh)))


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the backend's event loop: uvloop's when it is installed (the same asyncio API, its I/O layer in C: under
    a team's load most of the backend's time is per-request socket work), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


if __name__ == "__main__":
    main()
