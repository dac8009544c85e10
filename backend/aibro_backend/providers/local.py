"""The embedded default provider: each instance is an `aibro worker` process on this host, at cost 0."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def _gpus() -> list[str]:
    """GPU names from nvidia-smi, without importing TensorFlow into the backend."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines() if line.startswith("GPU ")]


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs and is not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


class LocalProvider:
    """Offers what this host really has: its CPUs as `local-cpu`, and each GPU as `local-gpuN`."""

    name = "local"

    def __init__(self, state_dir: Path, capacity: int | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.capacity = capacity or max(1, os.cpu_count() or 1)
        self._procs: dict[int, subprocess.Popen] = {}
        self._gpu_names = _gpus()

    def offers(self) -> list[dict[str, Any]]:
        base = {
            "provider": self.name,
            "vcpus": os.cpu_count() or 1,
            "memory_gib": _memory_gib(),
            "price_per_hour": 0.0,
            "on_demand_price_per_hour": 0.0,
            "spot": False,
            "availability": "available",
        }
        offers = [{**base, "machine_id": "local-cpu", "gpu_type": None, "gpu_count": 0, "capacity": self.capacity}]
        for i, name in enumerate(self._gpu_names):
            offers.append({**base, "machine_id": f"local-gpu{i}", "gpu_type": name, "gpu_count": 1, "capacity": 1})
        if len(self._gpu_names) > 1:
            offers.append(
                {
                    **base,
                    "machine_id": "local-gpu-all",
                    "gpu_type": self._gpu_names[0],
                    "gpu_count": len(self._gpu_names),
                    "capacity": 1,
                }
            )
        return offers

    def _visible_devices(self, machine_id: str) -> str:
        if machine_id == "local-cpu":
            return "-1"
        if machine_id == "local-gpu-all":
            return ",".join(str(i) for i in range(len(self._gpu_names)))
        return machine_id.removeprefix("local-gpu")

    def launch(self, instance_id: str, machine_id: str, env: dict[str, str]) -> int:
        workdir = self.state_dir / "workers" / instance_id
        workdir.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **env, "AIBRO_WORKER_DIR": str(workdir)}
        full_env["CUDA_VISIBLE_DEVICES"] = self._visible_devices(machine_id)
        full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        for leak in ("AIBRO_TOKEN", "AIBRO_BACKEND_URL"):
            full_env.pop(leak, None)
        log = open(workdir / "worker.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "aibro_backend.worker"],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(workdir),
        )
        log.close()
        self._procs[proc.pid] = proc
        return proc.pid

    def alive(self, instance: dict[str, Any]) -> bool:
        pid = instance.get("pid")
        proc = self._procs.get(pid) if pid else None
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)
            return False
        return pid_alive(pid)

    def terminate(self, instance: dict[str, Any]) -> None:
        pid = instance.get("pid")
        if pid and pid_alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        proc = self._procs.pop(pid, None) if pid else None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
