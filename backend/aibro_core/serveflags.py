"""The flags of `aibro backend serve`, defined once: the backend's own command line (aibro_backend.server.cli) and the
`aibro backend` CLI of the notebook package (which hands them on to it) both add them from here."""

from __future__ import annotations

import argparse
from typing import Any

# (flag, argparse keywords); defaults that come from the environment are filled in by the backend itself
SERVE_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--host", {"default": "127.0.0.1", "help": "address to bind (default 127.0.0.1; other than loopback: use TLS)"}),
    ("--port", {"type": int, "default": 0, "help": "port (default: any free port)"}),
    ("--certfile", {"default": None, "help": "serve HTTPS with this certificate (PEM)"}),
    ("--keyfile", {"default": None, "help": "the certificate's private key (PEM), if not in --certfile"}),
    (
        "--ca-bundle",
        {
            "default": None,
            "metavar": "FILE",
            "help": "the CA (PEM) that signed --certfile, when no system root did: workers verify this backend with it",
        },
    ),
    (
        "--provider",
        {
            "action": "append",
            "choices": ["local", "aws", "ray", "ssh"],
            "default": None,
            "help": "machines beside the local provider (always on): aws (needs --aws-config), ray (needs "
            "--ray-address), ssh (needs --ssh-hosts)",
        },
    ),
    ("--aws-config", {"default": None, "metavar": "FILE", "help": "the AWS provider's config (TOML or JSON)"}),
    ("--ray-address", {"default": None, "metavar": "ADDRESS", "help": "the Ray cluster: HOST:PORT of its GCS"}),
    ("--ray-worker-url", {"default": None, "metavar": "URL", "help": "this backend's URL as the Ray nodes reach it"}),
    (
        "--ray-node-resource",
        {"default": None, "metavar": "NAME", "help": "use only Ray nodes with this custom resource"},
    ),
    ("--ssh-hosts", {"default": None, "metavar": "FILE", "help": "the SSH provider's hosts file (TOML)"}),
    ("--ssh-worker-url", {"default": None, "metavar": "URL", "help": "this backend's URL as the SSH hosts reach it"}),
    (
        "--sandbox",
        {
            "choices": ["auto", "bwrap", "none"],
            "default": None,
            "help": "how local workers are confined: bwrap (bubblewrap), none (a backend of several users refuses "
            "it unless named here), auto (bwrap where it works; default)",
        },
    ),
)
ONLY_SERVE = (
    "--provider",
    "--aws-config",
    "--ray-address",
    "--ray-worker-url",
    "--ray-node-resource",
    "--ssh-hosts",
    "--ssh-worker-url",
)


def add_serve_flags(parser: argparse.ArgumentParser, help_prefix: str = "") -> None:
    for flag, kwargs in SERVE_FLAGS:
        parser.add_argument(flag, **{**kwargs, "help": help_prefix + kwargs["help"]})


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The flags given in `args`, as a command line again (to hand them on to the backend)."""
    argv: list[str] = []
    for flag, kwargs in SERVE_FLAGS:
        value = getattr(args, dest(flag), None)
        if value is None or value == kwargs.get("default"):
            continue
        for item in value if isinstance(value, list) else [value]:
            argv += [flag, str(item)]
    return argv


def given_only_for_serve(args: argparse.Namespace) -> list[str]:
    """Flags that mean something only to `serve`, given anyway."""
    return [flag for flag in ONLY_SERVE if getattr(args, dest(flag), None)]
