"""A layer that, built on a worker, takes more than a job may: open files, or disk (tests/test_job_limits.py). It
travels to the worker as source, so it imports nothing of aibro's."""

from __future__ import annotations

import os
from typing import Any

import keras


@keras.saving.register_keras_serializable(package="job_limits")
class Greedy(keras.layers.Layer):
    """Passes its input through. On a worker: `files` opens that many files and keeps them; `write_mb` writes one
    file of that size; `chunks_mb` writes that many files of 1 MB, one per call (so an epoch end finds them);
    `hold_mb` keeps that much memory, written so that it is resident."""

    def __init__(
        self,
        files: int = 0,
        write_mb: int = 0,
        chunks_mb: int = 0,
        hold_mb: int = 0,
        on_backend: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.files, self.write_mb, self.chunks_mb, self.hold_mb = files, write_mb, chunks_mb, hold_mb
        self.on_backend = on_backend  # only where Keras runs on this backend ("jax": a gang's members), if given
        if not os.environ.get("AIBRO_WORKER_DIR") or on_backend not in ("", keras.backend.backend()):
            return
        self._held = [open(os.devnull) for _ in range(files)]  # noqa: SIM115 - held on purpose
        self._memory = b"x" * (hold_mb << 20)
        if write_mb:
            with open("big.bin", "wb") as f:
                f.write(b"x" * (write_mb << 20))
        for i in range(chunks_mb):
            with open(f"chunk-{i}.bin", "wb") as f:
                f.write(b"x" * (1 << 20))

    def call(self, x: Any) -> Any:
        return x

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "files": self.files,
            "write_mb": self.write_mb,
            "chunks_mb": self.chunks_mb,
            "on_backend": self.on_backend,
            "hold_mb": self.hold_mb,
        }
