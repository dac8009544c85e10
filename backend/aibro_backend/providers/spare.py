"""The spare local worker: one process, started ahead of time, that has already imported TensorFlow.

Why: the first job of a session otherwise waits while a worker process starts and imports TensorFlow (4 s on an
idle host, 13 s on a busy one); a cooling worker removes that wait only for the jobs after it. The spare is what
a warm pool is for the first job: the local provider hands it the next `local-cpu` instance of the user it was
started for (a sandboxed worker runs as that user's uid, so a spare cannot change hands between users), then
starts the next spare. Cost: one idle worker's memory (about 0.5–0.8 GB with TensorFlow imported) and the CPU of
one TensorFlow import per job started. Off with AIBRO_SPARE_WORKER=0 (the embedded backend turns it on; `aibro
backend serve` leaves it off unless set)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SPARE_MACHINE = "local-cpu"
CRASH_WINDOW_S = 60.0  # a spare that dies this soon after starting, twice in a row, is not tried again
MODULE = "aibro_backend.worker.spare"
SPARE_DELAY_S = 5.0  # after a handover, the next spare waits this long: the new job's worker gears up first


@dataclass
class Spare:
    proc: subprocess.Popen
    workdir: Path
    user_id: int
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand_over(self, env: dict[str, str]) -> None:
        """Send the instance's environment; the spare becomes that instance's worker."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(env).encode() + b"\n")
        self.proc.stdin.close()

    def stop(self) -> None:
        """Kill the idle spare at once (it holds nothing); `reap` collects it, so the event loop never waits."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


class SpareCrashes:
    """Counts spares that died young, so a broken worker interpreter is reported once, not restarted forever."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def note_exit(self, spare: Spare) -> bool:
        """Record a spare that exited before use; True while it is still worth starting another."""
        young = time.monotonic() - spare.started < CRASH_WINDOW_S
        self.in_a_row = self.in_a_row + 1 if young else 0
        if self.in_a_row >= 2:
            log.warning(
                "the spare worker exited %d times in a row right after starting (see %s/worker.log); no more spares "
                "until the backend restarts: first jobs start a worker of their own",
                self.in_a_row,
                spare.workdir,
            )
            return False
        return True
