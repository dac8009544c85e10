"""A layer that, built on a worker, starts a detached sleeper and a TCP listener (tests/test_job_processes.py). It
travels to the worker as source, so it imports nothing of aibro's."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import keras

LINGER = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); time.sleep(3600)"


@keras.saving.register_keras_serializable(package="job_processes")
class Spawner(keras.layers.Layer):
    """Passes its input through; on a worker, it starts its processes as it is built (marked for the test)."""

    def __init__(self, marker: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker = marker
        if os.environ.get("AIBRO_WORKER_DIR") and marker:
            for code in ("import time; time.sleep(3600)", LINGER):
                subprocess.Popen(
                    [sys.executable, "-c", code, marker],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )

    def call(self, x: Any) -> Any:
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "marker": self.marker}
