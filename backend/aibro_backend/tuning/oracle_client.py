"""The backend's side of a study's oracle host (oracle_host.py): one process per study, started on first use and
started again when it died (the oracle reloads its saved state), even while it was starting, one request at a
time."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from aibro_core.models import OracleSpec

from .oracle_host import MAX_LINE, OracleAnswer, OracleRequest

log = logging.getLogger(__name__)
START_TRIES = 5
START_PAUSE_S = 0.5  # before the second start, twice that before the third: a host killed again and again


class OracleUnavailable(RuntimeError):
    """The study's oracle host could not start or answer (keras-tuner missing, a broken saved state)."""


class _Died(Exception):
    """The host process ended before its answer: started again, as one that died between requests is."""


class OracleHost:
    """Ask a study's oracle; the host process lives as long as this object is used and is closed with it."""

    def __init__(
        self, directory: Path, running: Callable[[], dict[str, str]] | None = None, python: str = sys.executable
    ) -> None:
        """`running` answers, whenever the host (re)starts, which trials still run as jobs and in which slot."""
        self.directory, self.python, self.running = Path(directory), python, running
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    @staticmethod
    def create(directory: Path, spec: OracleSpec, running: Callable[[], dict[str, str]] | None = None) -> OracleHost:
        """A new study's directory with its oracle's spec; the host starts at the first request."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "oracle-spec.json").write_text(spec.model_dump_json())
        return OracleHost(directory, running)

    async def ask(self, req: OracleRequest) -> OracleAnswer:
        """One request; a host that died (killed, out of memory) is started again and asked once more."""
        async with self.lock:
            for n in range(START_TRIES):
                if n:
                    await asyncio.sleep(START_PAUSE_S * 2 ** (n - 1))
                try:
                    proc = await self._running()
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(req.model_dump_json().encode() + b"\n")
                    await proc.stdin.drain()
                    line = await proc.stdout.readline()
                except (BrokenPipeError, ConnectionResetError, _Died):
                    line = b""
                if line:
                    return OracleAnswer.model_validate_json(line)
                proc, self.proc = self.proc, None
                code = await proc.wait() if proc is not None else None
                log.warning("oracle host of %s ended (exit %s); starting it again", self.directory, code)
            raise OracleUnavailable(
                f"the oracle of {self.directory.name} stopped answering {START_TRIES} times: see "
                f"{self.directory}/oracle-host.log"
            )

    async def _running(self) -> asyncio.subprocess.Process:
        if self.proc is not None and self.proc.returncode is None:
            return self.proc
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.directory / "oracle-host.log", "ab") as stderr:  # the child keeps its own copy
            self.proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                "aibro_backend.tuning.oracle_host",
                str(self.directory),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
                limit=MAX_LINE * 4,
            )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        ready = OracleAnswer.model_validate_json(await self._line(self.proc))
        if ready.ok and self.running is not None:
            resume = OracleRequest(op="resume", running=self.running())
            try:
                self.proc.stdin.write(resume.model_dump_json().encode() + b"\n")
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                raise _Died() from None
            ready = OracleAnswer.model_validate_json(await self._line(self.proc))
        if not ready.ok:
            await self.close()
            why = ready.error or f"the oracle host did not start: see {self.directory}/oracle-host.log"
            raise OracleUnavailable(why)
        return self.proc

    @staticmethod
    async def _line(proc: asyncio.subprocess.Process) -> bytes:
        """The host's next answer; _Died when it ended first (killed while it started, say): it is started again.
        A host that answers that it cannot start (keras-tuner missing, a broken saved state) says so instead."""
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise _Died()
        return line

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
