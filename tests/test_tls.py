"""Issue 11 item 10: a backend served over HTTPS (`--certfile/--keyfile`) with a certificate from a private CA is
verified by everything that talks to it, through the one transport: a client given the CA bundle (`aibro login
URL --ca-bundle FILE`, AIBRO_CA_BUNDLE) trains a job end to end, its worker verifying too (the backend's
`--ca-bundle` reaches local workers as a copy, cloud machines through their user data); a client without it is
refused with an error that names the fix; the Jupyter server extension's proxy follows the same rule."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cryptography  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import pytest
from backend_proc import own_backend

from aibro_core import vocabulary as v
from aibro_core.transport import UntrustedCertificate
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model
from helpers import slow_data, user_data_config, user_env, wait_for

# a client refused on purpose: the backend's TLS layer notes the handshake its client broke off
pytestmark = [pytest.mark.fast, pytest.mark.backend_log(r"SSL Error on \d+ .*TLSV1_ALERT_UNKNOWN_CA")]


def _pem_files(d: Path) -> dict[str, Path]:
    """A private CA and a certificate for 127.0.0.1 that it signed (PEM files), made here and now."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aibro test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    files["key"].chmod(0o600)
    return files


@pytest.fixture(scope="module")
def https_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("tls")
    pem = _pem_files(d)
    args = ("--certfile", str(pem["cert"]), "--keyfile", str(pem["key"]), "--ca-bundle", str(pem["ca"]))
    with own_backend(d / "home", *args) as b:
        assert b.url.startswith("https://127.0.0.1:"), b.url
        yield {"backend": b, "pem": pem, "dir": d}


def _refusal_names_the_fix(message: str, url: str) -> None:
    assert f"the backend at {url} presented a TLS certificate that does not verify" in message, message
    assert "--ca-bundle FILE" in message and "AIBRO_CA_BUNDLE" in message, message


def test_a_client_with_the_ca_bundle_trains_end_to_end_and_one_without_is_refused(
    https_backend: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIBRO_CA_BUNDLE", raising=False)
    b, ca = https_backend["backend"], str(https_backend["pem"]["ca"])

    with pytest.raises(UntrustedCertificate) as refused:
        BackendClient(b.url, b.token).health()
    _refusal_names_the_fix(str(refused.value), b.url)

    client = BackendClient(b.url, b.token, ca_bundle=ca)
    assert client.health().user
    x, y = slow_data(400)
    job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2, batch_size=32))
    events = wait_for(
        client,
        job.job_id,
        lambda evs: any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs),
        timeout=600,
    )
    done = client.job(job.job_id)
    # the worker reached the backend only through HTTPS verified against the CA bundle the backend handed it
    assert done.status == v.COMPLETED, [e["data"] for e in events if e["type"] in ("log", "error")][-5:]
    assert [e["data"]["epoch"] for e in events if e["type"] == "epoch"] == [0, 1]

    monkeypatch.setenv("AIBRO_CA_BUNDLE", ca)  # the environment does what --ca-bundle does
    assert BackendClient(b.url, b.token).health().user


def test_aibro_login_keeps_the_ca_bundle_and_without_it_names_the_option(https_backend: dict, tmp_path: Path) -> None:
    b, ca = https_backend["backend"], str(https_backend["pem"]["ca"])
    home = tmp_path / "user"
    env = user_env(home)
    env.pop("AIBRO_CA_BUNDLE", None)

    def aibro(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "aibro_jupyter.cli", *args]
        return subprocess.run(cmd, env=env, input=b.token + "\n", capture_output=True, text=True, timeout=120)

    refused = aibro("login", b.url, "--token-stdin")
    assert refused.returncode != 0 and not (home / "login.json").exists()
    _refusal_names_the_fix(refused.stderr, b.url)

    done = aibro("login", b.url, "--token-stdin", "--ca-bundle", ca)
    assert done.returncode == 0, done.stderr
    saved = json.loads((home / "login.json").read_text())
    assert saved["ca_bundle"] == ca and (home / "login.json").stat().st_mode & 0o777 == 0o600
    status = aibro("backend", "status")
    assert status.returncode == 0 and f"configured backend at {b.url}: ok" in status.stdout, status.stderr


def test_the_server_extension_proxy_verifies_with_the_ca_bundle(
    https_backend: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aibro_jupyter import config
    from aibro_jupyter.server.upstream import Unreachable, Upstream

    monkeypatch.delenv("AIBRO_CA_BUNDLE", raising=False)
    b, ca = https_backend["backend"], str(https_backend["pem"]["ca"])

    async def health(ca_bundle: str | None) -> Any:
        upstream = Upstream(logging.getLogger("test"))
        upstream._target = config.Target(b.url, b.token, False, ca_bundle)
        return await upstream.forward("GET", "/health", {}, 0)

    answer = asyncio.run(health(ca))
    assert answer.status == 200 and json.loads(answer.body)["user"]
    with pytest.raises(Unreachable) as refused:
        asyncio.run(health(None))
    assert "TLS certificate is not trusted" in refused.value.args[0]
    _refusal_names_the_fix(refused.value.detail, b.url)


def test_a_cloud_machine_gets_the_ca_bundle_in_its_user_data(https_backend: dict, tmp_path: Path) -> None:
    from aibro_backend.providers import shipping
    from aibro_backend.providers.aws import (
        USER_DATA_LIMIT,
        build_user_data,
        parse_user_data_ca,
        parse_user_data_env,
    )

    pem = https_backend["pem"]["ca"].read_text()
    agent = shipping.served(tmp_path / "agent")
    cfg = user_data_config()
    script = build_user_data(cfg, "inst-1", "aibro_e_" + "x" * 32, agent, ca_pem=pem)
    assert len(script.encode()) <= USER_DATA_LIMIT
    assert parse_user_data_env(script)["AIBRO_CA_BUNDLE"] == "/etc/aibro/ca.pem"
    assert parse_user_data_ca(script) == pem, "the bootstrap writes the PEM as given"
    assert "AIBRO_CA_BUNDLE" not in parse_user_data_env(build_user_data(cfg, "inst-1", "aibro_e_" + "x" * 32, agent))
    with pytest.raises(ValueError, match="the CA bundle: give only the CA that signed"):
        build_user_data(cfg, "inst-1", "aibro_e_" + "x" * 32, agent, ca_pem=pem * 40)
    with pytest.raises(ValueError, match="PEM certificates"):
        build_user_data(cfg, "inst-1", "aibro_e_" + "x" * 32, agent, ca_pem="AIBRO_ENV\nrm -rf /")
