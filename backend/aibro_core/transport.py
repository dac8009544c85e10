"""Bearer-token JSON over HTTP with errors a user can act on: the one transport of clients and workers."""

from __future__ import annotations

from typing import Any

import requests

from .errors import ApiError, AuthError, BackendUnreachable


class Transport:
    """Bearer-token JSON over HTTP with errors a user can act on. Shared by the client and the worker."""

    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> requests.Response:
        resp = self.send(method, path, timeout=timeout, **kw)
        if resp.status_code == 401:
            raise AuthError(
                f"the backend at {self.url} rejected the token ({_message(resp)}): "
                "run `aibro login URL --token TOKEN` or set AIBRO_TOKEN"
            )
        if resp.status_code >= 400 and not (method == "HEAD" and resp.status_code == 404):
            raise ApiError(resp.status_code, _message(resp), _body(resp))
        return resp

    def send(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> requests.Response:
        """One call, whatever status it answers; only an unreachable backend raises (the proxy passes errors on)."""
        try:
            return self.session.request(method, f"{self.url}/api/v1{path}", timeout=timeout or self.timeout, **kw)
        except requests.ConnectionError:
            raise BackendUnreachable(
                f"cannot reach the aibro backend at {self.url}: start it with `aibro backend start`, "
                "or unset AIBRO_BACKEND_URL to use the embedded one"
            ) from None
        except requests.Timeout:
            raise BackendUnreachable(f"the aibro backend at {self.url} did not answer in time") from None

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()


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
