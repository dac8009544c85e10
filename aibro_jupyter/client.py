"""The one place that speaks HTTP to the backend: REST calls, chunked blob upload, event long-poll."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aibro_core.errors import BackendUnreachable
from aibro_core.transport import Transport

CHUNK = 8 * 1024 * 1024


class BackendClient:
    """What kernels, the CLI and the server extension ask of the backend."""

    def __init__(self, url: str, token: str) -> None:
        self.t = Transport(url, token)
        self.url = self.t.url

    # -- discovery --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self.t.json("GET", "/health", timeout=5)

    def machines(self) -> list[dict[str, Any]]:
        return self.t.json("GET", "/machines")["machines"]

    def policy(self) -> dict[str, Any]:
        return self.t.json("GET", "/policy")

    def counters(self) -> dict[str, int]:
        return self.t.json("GET", "/stats")["counters"]

    # -- blobs ------------------------------------------------------------------------------------
    def upload_blob(self, path: Path, sha: str | None = None) -> tuple[str, int]:
        """Upload a file content-addressed, resuming a partial upload; returns (sha, bytes sent)."""
        path = Path(path)
        sha = sha or sha256_file(path)
        total = path.stat().st_size
        head = self.t.request("HEAD", f"/blobs/{sha}")
        if head.status_code == 200:
            return sha, 0
        offset = int(head.headers.get("X-Received", "0"))
        sent = 0
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                chunk = f.read(CHUNK)
                if not chunk and offset >= total and total > 0:
                    break
                r = self.t.json("PUT", f"/blobs/{sha}", params={"offset": offset, "total": total}, data=chunk)
                offset += len(chunk)
                sent += len(chunk)
                if r["complete"]:
                    break
        return sha, sent

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.t.json("POST", "/jobs", json=spec)

    def jobs(self) -> list[dict[str, Any]]:
        return self.t.json("GET", "/jobs")["jobs"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.t.json("GET", f"/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.t.json("POST", f"/jobs/{job_id}/cancel")

    def replay(self, job_id: str, **overrides: Any) -> dict[str, Any]:
        return self.t.json("POST", f"/jobs/{job_id}/replay", json=overrides)

    def events(self, job_id: str, after: int = 0, wait: float = 0) -> dict[str, Any]:
        return self.t.json("GET", f"/jobs/{job_id}/events", params={"after": after, "wait": wait}, timeout=wait + 30)

    def follow(self, job_id: str, after: int = 0, wait: float = 25) -> Iterator[dict[str, Any]]:
        """Every event of a job from `after`, live, until the job is final; reconnects on its own."""
        while True:
            try:
                page = self.events(job_id, after, wait)
            except BackendUnreachable:
                time.sleep(1.0)
                continue
            for ev in page["events"]:
                after = ev["seq"]
                yield ev
            if not page["events"] and page["status"] in ("COMPLETED", "CANCELED"):
                return

    def user_events(self, after: int = 0, wait: float = 0) -> dict[str, Any]:
        return self.t.json("GET", "/events", params={"after": after, "wait": wait}, timeout=wait + 30)

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        return self.t.json("GET", f"/jobs/{job_id}/artifacts")["artifacts"]

    def download_artifact(self, job_id: str, name: str, dest: Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        resp = self.t.request("GET", f"/jobs/{job_id}/artifacts/{name}", stream=True)
        with open(dest, "wb") as f:
            for chunk in resp.iter_content(1 << 20):
                f.write(chunk)
        return dest

    # -- instances --------------------------------------------------------------------------------
    def instances(self) -> list[dict[str, Any]]:
        return self.t.json("GET", "/instances")["instances"]

    def terminate(self, instance_id: str) -> dict[str, Any]:
        return self.t.json("POST", f"/instances/{instance_id}/terminate")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
