"""Every process a job starts dies with the job. The agent becomes the subreaper of everything it starts (a child
that double-forks or calls setsid is still re-parented to it, not to the host's init), and when a job ends every
process below the agent is killed, whatever it made of itself. When an instance closes (or a clean stop closes
them all) the provider kills every process below the worker first, then the worker's process group; in the sandbox
that also ends the worker's PID namespace, and everything in it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("aibro.worker")
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of this process's descendants come back to it (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every live process below `root`, read from /proc (parent links), children after their parents."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_job_processes() -> int:
    """Kill every process the job left below the agent (detached ones included) and reap them; how many."""
    me = os.getpid()
    killed = 0
    for _ in range(5):  # a process may fork while its siblings are being killed: look again
        left = descendants(me)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        _reap()
        time.sleep(0.05)
    if killed:
        log.info("ended %d process(es) the job left running", killed)
    return killed


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
