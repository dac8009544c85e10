"""The listener's TLS, and the warning a backend serving plain HTTP beyond this host prints at start."""

from __future__ import annotations

import ipaddress
import ssl


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plain_http_warning(host: str) -> str:
    return (
        f"aibro backend: WARNING: listening on {host} over plain HTTP: tokens, models and data cross the network "
        "unencrypted and anyone who can reach this port can try tokens. Serve TLS (--certfile CERT --keyfile KEY), "
        "or keep --host 127.0.0.1 behind an HTTPS reverse proxy."
    )


def tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx
