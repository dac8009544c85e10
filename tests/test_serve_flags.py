"""The flags of `aibro backend serve` are defined once (aibro_core/serveflags.py, issue 25 item 5): the CLI hands
every one it was given to the backend's own command line, which reads the same values back."""

from __future__ import annotations

import pytest

from aibro_backend.server.cli import build_parser as backend_parser
from aibro_core.errors import AibroError
from aibro_core.serveflags import SERVE_FLAGS, dest, serve_argv
from aibro_jupyter.cli import build_parser as cli_parser
from aibro_jupyter.cli import cmd_backend

pytestmark = pytest.mark.fast

GIVEN = [
    *("--host", "0.0.0.0", "--port", "8765", "--certfile", "c.pem", "--keyfile", "k.pem", "--ca-bundle", "ca.pem"),
    *("--provider", "aws", "--provider", "ray", "--aws-config", "aws.toml", "--ray-address", "10.0.0.1:6379"),
    *("--ray-worker-url", "http://10.0.0.2:8765", "--ray-node-resource", "team-a", "--sandbox", "none"),
    *("--provider", "ssh", "--ssh-hosts", "hosts.toml", "--ssh-worker-url", "http://10.0.0.2:8765"),
]


def test_every_serve_flag_reaches_the_backend_as_given() -> None:
    assert {flag for flag, _ in SERVE_FLAGS} == set(GIVEN[::2]), "the test gives every flag"
    cli = cli_parser().parse_args(["backend", "serve", *GIVEN])
    backend = backend_parser().parse_args(["--home", "/h", *serve_argv(cli)])
    for flag, _ in SERVE_FLAGS:
        assert getattr(backend, dest(flag)) == getattr(cli, dest(flag)), flag
    assert serve_argv(cli_parser().parse_args(["backend", "serve"])) == [], "defaults are left to the backend"


def test_serve_only_flags_elsewhere_are_refused_naming_them() -> None:
    args = cli_parser().parse_args(["backend", "status", "--aws-config", "aws.toml", "--ray-address", "h:1"])
    with pytest.raises(AibroError, match=r"--aws-config, --ray-address go with `aibro backend serve`"):
        cmd_backend(args)
