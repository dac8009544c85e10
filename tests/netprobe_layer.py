"""A layer that, built on a worker, tries the network as a teammate's code would (tests/test_job_network.py): a
port another program listens on at 127.0.0.1, the backend's event port, the internet, the backend's own port, and
the backend itself. It writes what happened to `netprobe.json` in the job's folder. It travels to the worker as
source, so it imports nothing of aibro's."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any

import keras


def _try(found: dict[str, str], name: str, host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=10):
            found[name] = "CONNECTED"
    except OSError as exc:
        found[name] = type(exc).__name__


def probe(targets: dict[str, int]) -> dict[str, str]:
    found: dict[str, str] = {}
    _try(found, "host_listener", "127.0.0.1", targets["host_listener"])
    _try(found, "events_port", "127.0.0.1", targets["events_port"])
    _try(found, "internet", "pypi.org", 443)
    url = os.environ["AIBRO_WORKER_URL"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        held = socket.socket()
        held.bind(("127.0.0.1", port))
        held.listen()
        found["backend_port"] = "BOUND"
    except OSError as exc:
        found["backend_port"] = type(exc).__name__
    try:
        urllib.request.urlopen(url + "/api/v1/health", timeout=30)  # noqa: S310 - the backend's own URL
        found["backend"] = "200"
    except urllib.error.HTTPError as exc:
        found["backend"] = str(exc.code)  # 401: it answered, and wants a token
    except OSError as exc:
        found["backend"] = type(exc).__name__
    return found


@keras.saving.register_keras_serializable(package="job_network")
class NetProbe(keras.layers.Layer):
    """Passes its input through; on a worker it probes the network once, as it is built."""

    def __init__(self, targets: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.targets = dict(targets or {})
        workdir = os.environ.get("AIBRO_WORKER_DIR")
        if workdir and self.targets:
            with open(os.path.join(workdir, "netprobe.json"), "w") as f:
                json.dump(probe(self.targets), f)

    def call(self, x: Any) -> Any:
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "targets": self.targets}
