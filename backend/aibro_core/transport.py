"""Bearer-token JSON over HTTP with errors a user can act on: the one transport of clients and workers.

It also decides how a backend served over HTTPS is verified, for every part that talks to one (clients, worker
agents, the Jupyter server extension's proxy): against the CA bundle given (`aibro login URL --ca-bundle FILE`,
or AIBRO_CA_BUNDLE, which the backend passes on to its workers), else against the system's trusted roots. A
certificate that does not verify is refused with an error naming that option; it is never skipped.
"""

from __future__ import annotations

import os
import re
import ssl
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from .errors import ApiError, AuthError, BackendUnreachable

CA_BUNDLE_ENV = "AIBRO_CA_BUNDLE"
TimeoutArg = float | tuple[float, float] | None  # seconds, or requests' (connect, read) pair
EVENT_PORT_RECHECK_S = 60.0  # after the event port failed, long-polls use the main port this long before asking again
EVENT_PORT_CONNECT_S = 3.0  # a firewalled event port (packets dropped) costs this, once, not a long-poll's timeout


def may_have_event_port(url: str) -> bool:
    """A backend reached at a bare host:port may have an event port beside it; one behind a path (a proxy that
    maps one port only) is not asked for one."""
    parts = urlsplit(url)
    return parts.path in ("", "/") and bool(parts.hostname)


def event_port_url(url: str, port: object) -> str | None:
    """Where long-polls go for a backend at `url` whose /health announced `events_port` = `port`: the same scheme
    and host on that port (backend/aibro_backend/api/eventport.py answers them for a fifth of the CPU). None when
    there is no such port or the backend sits behind a path."""
    if not may_have_event_port(url) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in str(parts.hostname) else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


class UntrustedCertificate(BackendUnreachable):
    """The backend answered over TLS with a certificate that does not verify against the CA bundle in use."""


def ca_bundle(explicit: str | None = None) -> str | None:
    """The CA bundle (PEM file) to verify the backend with: the one given, else AIBRO_CA_BUNDLE, else None (the
    system's trusted roots). A bundle that cannot be read is refused here, naming it."""
    path = explicit or os.environ.get(CA_BUNDLE_ENV) or None
    if path is not None and not os.access(path, os.R_OK):
        raise BackendUnreachable(
            f"the CA bundle {path} cannot be read: give the PEM file of the CA that signed the backend's "
            f"certificate (aibro login URL --ca-bundle FILE, or {CA_BUNDLE_ENV}=FILE)"
        )
    return path


def ssl_context(bundle: str | None) -> ssl.SSLContext:
    """An SSL context that verifies the backend against `bundle` (or the system's roots): for HTTP clients that
    are not this transport (the server extension's tornado client)."""
    return ssl.create_default_context(cafile=bundle) if bundle else ssl.create_default_context()


def untrusted_message(url: str, reason: object, bundle: str | None) -> str:
    """What a refused certificate means and how to fix it."""
    given = f"the CA bundle {bundle}" if bundle else "the system's trusted certificates"
    return (
        f"the backend at {url} presented a TLS certificate that does not verify against {given} ({reason}): "
        f"give the CA bundle that signed it: `aibro login {url} --ca-bundle FILE`, or set {CA_BUNDLE_ENV}=FILE "
        "(its workers get it from `aibro backend serve --ca-bundle FILE`)"
    )


SEND_BLOCK = 1 << 20


class _LargeBlocks(HTTPAdapter):
    """Bodies (upload chunks of 8 MiB) go to the socket 1 MiB per send, not urllib3's 16 KiB: 64 times fewer system
    calls and Python loop turns for every byte uploaded."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, blocksize=SEND_BLOCK, **kwargs)


class Transport:
    """Bearer-token JSON over HTTP with errors a user can act on. Shared by the client and the worker."""

    def __init__(self, url: str, token: str, timeout: float = 30.0, ca_bundle_file: str | None = None) -> None:
        """`ca_bundle_file`: the PEM file to verify an HTTPS backend with (default AIBRO_CA_BUNDLE, else the
        system's trusted roots)."""
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.ca_bundle = ca_bundle(ca_bundle_file) if self.url.startswith("https:") else ca_bundle_file
        self.session = requests.Session()
        for scheme in ("http://", "https://"):
            self.session.mount(scheme, _LargeBlocks())
        self.session.verify = self.ca_bundle or True
        self.session.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, *, timeout: TimeoutArg = None, **kw: Any) -> requests.Response:
        resp = self.send(method, path, timeout=timeout, **kw)
        if resp.status_code == 401:
            raise AuthError(
                f"the backend at {self.url} rejected the token ({_message(resp)}): "
                "run `aibro login URL --token TOKEN` or set AIBRO_TOKEN"
            )
        if resp.status_code >= 400 and not (method == "HEAD" and resp.status_code == 404):
            raise ApiError(resp.status_code, _message(resp), _body(resp))
        return resp

    def send(
        self, method: str, path: str, *, timeout: TimeoutArg = None, base: str | None = None, **kw: Any
    ) -> requests.Response:
        """One call, whatever status it answers; only an unreachable backend raises (the proxy passes errors on).
        `base` sends it to another listener of the same backend (its event port) instead of `url`; `timeout` is
        seconds, or requests' (connect, read) pair."""
        # verify per call: requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's own `verify`
        kw.setdefault("verify", self.session.verify)
        try:
            return self.session.request(
                method, f"{base or self.url}/api/v1{path}", timeout=timeout or self.timeout, **kw
            )
        except requests.exceptions.SSLError as exc:
            raise UntrustedCertificate(untrusted_message(self.url, _ssl_reason(exc), self.ca_bundle)) from None
        except (requests.ConnectionError, requests.Timeout) as exc:
            if _elsewhere(exc, base or self.url):
                raise  # where the backend redirected it (a presigned S3 URL) failed: not the backend
            if isinstance(exc, requests.ConnectionError):
                raise BackendUnreachable(
                    f"cannot reach the aibro backend at {self.url}: start it with `aibro backend start`, "
                    "or unset AIBRO_BACKEND_URL to use the embedded one"
                ) from None
            raise BackendUnreachable(f"the aibro backend at {self.url} did not answer in time") from None

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()


def _ssl_reason(exc: BaseException) -> str:
    """The SSL error's own words, out of the several layers requests wraps it in."""
    m = re.search(r"certificate verify failed: ([^(']+?) \(", str(exc))
    return m.group(1) if m else "the TLS handshake failed"


def _elsewhere(exc: requests.RequestException, url: str) -> bool:
    """Whether the request that failed went to another host than `url`: a redirect's target."""
    failed = getattr(getattr(exc, "request", None), "url", None)
    return bool(failed) and urlsplit(str(failed)).netloc != urlsplit(url).netloc


def _message(resp: requests.Response) -> str:
    try:
        return str(resp.json().get("error") or resp.reason)
    except ValueError:
        return resp.text[:300] or str(resp.reason)


def _body(resp: requests.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
