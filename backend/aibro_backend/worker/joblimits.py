"""What one job may take of the machine it runs on, from the backend operator's settings (AIBRO_JOB_MAX_* in the
backend's environment, handed to its workers): open files and the size of any one file as rlimits of the worker,
processes as an rlimit of the sandbox's per-user uid, the disk its folder holds, measured every epoch, and the
memory of the worker with every process below it, sampled four times a second (MemoryWatch). A job that goes over
one ends with a message naming the limit and where it is set."""

from __future__ import annotations

import errno
import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path

from .jobprocs import descendants, end_job_processes

GiB = 1024**3


class OverLimit(RuntimeError):
    """The job went over one of its limits; the message names it."""


@dataclass(frozen=True)
class JobLimits:
    max_open_files: int = 4096
    max_processes: int = 4096  # tasks of the job's uid: TensorFlow alone runs a hundred threads or more
    max_disk_bytes: int = 20 * GiB
    max_memory_bytes: int = 0  # 0: none (the backend sets one per job: scheduling/jobmemory.py)

    def apply(self) -> None:
        """The rlimits of this worker process, inherited by everything it starts."""
        _lower(resource.RLIMIT_NOFILE, self.max_open_files)
        _lower(resource.RLIMIT_FSIZE, self.max_disk_bytes)
        if os.getuid() != 0:  # the sandbox's per-user uid (root is exempt from it anyway)
            _lower(resource.RLIMIT_NPROC, self.max_processes)

    def check_disk(self, folder: Path, skip: tuple[str, ...] = ("cache",)) -> None:
        """Raise OverLimit when the job's folder (its downloaded inputs in `cache` aside) holds more than allowed."""
        used = folder_bytes(folder, skip)
        if used > self.max_disk_bytes:
            raise OverLimit(
                f"the job's folder holds {size_text(used)}, over its limit of {size_text(self.max_disk_bytes)} "
                "(AIBRO_JOB_MAX_DISK_BYTES where the backend runs): write less (fewer or smaller files and "
                "checkpoints), or ask the backend's operator to raise it"
            )

    def explain(self, exc: BaseException) -> str | None:
        """The limit behind an OSError the job's code met, in words; None for any other failure."""
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, OverLimit):
                return str(seen)
            if isinstance(seen, OSError) and seen.errno == errno.EMFILE:
                return (
                    f"the job opened more than {self.max_open_files} files at once, its limit "
                    "(AIBRO_JOB_MAX_OPEN_FILES where the backend runs): close files when done with them"
                )
            if isinstance(seen, OSError) and seen.errno == errno.EFBIG:
                return (
                    f"the job wrote a file over {size_text(self.max_disk_bytes)}, its disk limit "
                    "(AIBRO_JOB_MAX_DISK_BYTES where the backend runs): write smaller files"
                )
            if isinstance(seen, BlockingIOError) or (isinstance(seen, OSError) and seen.errno == errno.EAGAIN):
                return (
                    f"the job could not start another process: its user may run at most {self.max_processes} "
                    "(AIBRO_JOB_MAX_PROCESSES where the backend runs)"
                )
            seen = seen.__cause__ or seen.__context__
        return None


def size_text(n: int) -> str:
    """Bytes as a person reads them in a limit's message (1.5 GiB, 300.0 MiB)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def folder_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    total = 0
    for root, dirs, files in os.walk(folder):
        if Path(root) == folder:
            dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def _lower(which: int, value: int) -> None:
    """Both limits down to `value` at most: the job's code cannot raise its soft limit past it again."""
    soft, hard = resource.getrlimit(which)
    new_hard = value if hard == resource.RLIM_INFINITY else min(value, hard)
    new_soft = new_hard if soft == resource.RLIM_INFINITY else min(soft, new_hard)
    resource.setrlimit(which, (new_soft, new_hard))


def tree_rss(root: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of `root` and every live process below it."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in [root, *descendants(root, proc)]:
        try:
            total += int((proc / str(pid) / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


class MemoryWatch:
    """While a job runs: the memory of this worker and every process below it, sampled every `every_s`. Over the
    limit, the job's own processes are killed at once and `check()` (called after the model loads and at every
    batch's end) raises OverLimit naming the limit; `peak` is what the job held at most."""

    def __init__(self, limit: int, every_s: float = 0.25) -> None:
        self.limit, self.every_s = limit, every_s
        self.over: str | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aibro-memory", daemon=True)

    def __enter__(self) -> MemoryWatch:
        if self.limit:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> None:
        if self.over:
            raise OverLimit(self.over)

    def sample(self) -> int:
        used = tree_rss(os.getpid())
        self.peak = max(self.peak, used)
        if self.limit and used > self.limit and self.over is None:
            self.over = (
                f"the job held {size_text(used)} of memory (its worker and every process it started), over its "
                f"limit of {size_text(self.limit)} (AIBRO_JOB_MAX_MEMORY_BYTES where the backend runs; unset, a "
                "backend of several users gives each job its share of the machine): use smaller batches, data or "
                "models, or ask the backend's operator to raise it"
            )
            end_job_processes()
        return used

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()
