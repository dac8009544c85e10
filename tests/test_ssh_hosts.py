"""The SSH provider's hosts file (providers/ssh_hosts.py): every problem named at once, before any host is tried."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aibro_backend.providers.ssh_hosts import HostsError, load_hosts

pytestmark = pytest.mark.fast


def test_a_good_file_gives_its_hosts_with_defaults(tmp_path: Path) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    path = tmp_path / "hosts.toml"
    path.write_text(f'[[host]]\nname = "lab1"\nhost = "10.0.0.5"\nuser = "alice"\nidentity_file = "{key}"\n')
    (host,) = load_hosts(path)
    assert (host.name, host.port, host.max_jobs, host.gpus) == ("lab1", 22, 1, None)


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(
        '[[host]]\nname = "Lab 1"\nhost = "h"\nport = 0\nuser = "alice"\nidentity_file = "/no/such/key"\n'
        '[[host]]\nname = "b"\nhost = "h"\nuser = "bob"\nidentity_file = "/no/such/key"\nmax_jobs = 0\ncolor = 1\n'
    )
    with pytest.raises(HostsError) as err:
        load_hosts(path)
    text = str(err.value)
    for needle in (
        "host.0.name",
        "host.0.port",
        "host.0.identity_file: the identity file /no/such/key does not exist",
        "host.1.max_jobs",
        "host.1.color",
    ):
        assert needle in text, (needle, text)
    assert len(err.value.problems) == 6, err.value.problems


def test_twice_the_same_name_and_broken_toml_are_named(tmp_path: Path) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    path = tmp_path / "hosts.toml"
    one = f'[[host]]\nname = "a"\nhost = "h"\nuser = "u"\nidentity_file = "{key}"\n'
    path.write_text(one + one)
    with pytest.raises(HostsError, match="host names must differ: a appear"):
        load_hosts(path)
    path.write_text("[[host]\n")
    with pytest.raises(HostsError, match="not valid TOML"):
        load_hosts(path)
