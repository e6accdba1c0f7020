"""Child processes of ``haru demo``: each in its own session, logged to a file, always reaped.

Every child is started with ``start_new_session=True``, so its process id is also its process
group id and one ``killpg`` reaches whatever it spawned inside its group. Stopping is SIGTERM to
the group, then SIGKILL after a grace. A module-level registry of live groups is SIGKILLed by an
``atexit`` hook as a last resort, for the paths where the orderly ``finally`` could not run.

Trainers are started by the supervisors in sessions of their own (DESIGN 6.5), so they are not in
any group the demo started; :func:`kill_stray_trainers` finds the ones that still carry a
checkpoint directory inside the demo's workdir and kills them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from haru_sim.nvidia_smi import trainer_processes

logger = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 4000
_POLL_S = 0.025


class DemoError(Exception):
    """The demo's local fleet could not be started, driven or stopped as asked.

    The root of haru-demo's own exceptions.
    """


# Process groups started by this process and not yet reaped: the atexit hook's work list.
_live_groups: set[int] = set()
# Tasks killing children whose spawn was cancelled while they were being created.
_orphans: set[asyncio.Task[None]] = set()


def _kill_live_groups() -> None:
    for pgid in sorted(_live_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    _live_groups.clear()


atexit.register(_kill_live_groups)


def log_tail(path: Path, limit: int = _LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a log file, decoded leniently ("" when unreadable)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass(eq=False)
class ChildProcess:
    """One child process of the demo (a server, a supervisor or an emulated vLLM server).

    Attributes:
        name: Short name for messages and the view (``server``, ``supervisor-alpha``, ...).
        argv: The command it runs.
        log_path: File receiving its stdout and stderr.
        process: The running process.
        log_offset: Size of the log when it was spawned (a restarted child appends to the
            same file; only what this run wrote is searched).
        started_at: Monotonic time of the spawn.
    """

    name: str
    argv: tuple[str, ...]
    log_path: Path
    process: asyncio.subprocess.Process
    log_offset: int = 0
    started_at: float = field(default_factory=time.monotonic)
    _finished: bool = field(default=False, init=False, repr=False)

    @property
    def pid(self) -> int:
        """Process id, which is also its process group id."""
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the process has not been reaped yet."""
        return self.process.returncode is None

    def signal_group(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the child's whole process group (no-op once it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    async def wait_for_line(self, pattern: re.Pattern[str], *, timeout_s: float) -> re.Match[str]:
        """Wait until the child's log holds a line matching ``pattern``.

        Raises:
            DemoError: The child exited first, or the line did not come in time; the message
                carries the end of its log.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            text = self._read_log()
            match = pattern.search(text)
            if match is not None:
                return match
            if not self.running:
                raise DemoError(
                    f"{self.name} exited with status {self.process.returncode} before it was "
                    f"ready; end of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() >= deadline:
                raise DemoError(
                    f"{self.name} did not get ready within {timeout_s:.0f}s; end of "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            await asyncio.sleep(_POLL_S)

    def _read_log(self) -> str:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(self.log_offset)
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    async def stop(self, *, grace_s: float) -> int:
        """SIGTERM the group, SIGKILL it after ``grace_s``, and reap the child.

        Stopping a child that was already stopped or killed does nothing more (its process
        group id may belong to someone else by now).

        Returns:
            The exit status (negative: killed by that signal).
        """
        if self._finished:
            return await self.process.wait()
        if self.running:
            self.signal_group(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await self.process.wait()
            except TimeoutError:
                logger.warning("%s ignored SIGTERM for %.1fs: SIGKILL", self.name, grace_s)
        # Whatever else lives in its group goes too, even when the leader exited by itself.
        return await self.kill()

    async def kill(self) -> int:
        """SIGKILL the group at once (a crash, not a shutdown) and reap the child."""
        if not self._finished:
            self.signal_group(signal.SIGKILL)
            self._finished = True
            _live_groups.discard(self.pid)
        return await self.process.wait()


async def spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
) -> ChildProcess:
    """Start ``argv`` in a new session with stdout and stderr appended to ``log_path``.

    Raises:
        DemoError: The executable could not be started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        offset = log.tell()
        creation = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        )
        try:
            process = await asyncio.shield(creation)
        except asyncio.CancelledError:
            # Cancelled while the child was being created: it must not outlive the demo.
            reaper = asyncio.create_task(_kill_when_created(creation), name=f"reap-{name}")
            _orphans.add(reaper)
            reaper.add_done_callback(_orphans.discard)
            raise
        except OSError as exc:
            raise DemoError(f"cannot start {name} ({argv[0]}): {exc}") from exc
    _live_groups.add(process.pid)
    return ChildProcess(
        name=name, argv=tuple(argv), log_path=log_path, process=process, log_offset=offset
    )


async def _kill_when_created(creation: asyncio.Future[asyncio.subprocess.Process]) -> None:
    try:
        process = await creation
    except (OSError, asyncio.CancelledError):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


async def reap_orphans() -> None:
    """Wait until every child whose spawn was cancelled half-way is killed and reaped."""
    while _orphans:
        await asyncio.gather(*_orphans, return_exceptions=True)


def find_stray_trainers(checkpoint_root: Path) -> list[int]:
    """Pids of live processes whose ``HARU_CHECKPOINT_DIR`` lies inside ``checkpoint_root``."""
    root = str(checkpoint_root.resolve())
    return sorted(
        pid
        for pid, directory in trainer_processes().items()
        if directory == root or directory.startswith(root + os.sep)
    )


def kill_stray_trainers(checkpoint_root: Path) -> list[int]:
    """SIGKILL the process group of every trainer :func:`find_stray_trainers` reports.

    A supervisor that was itself SIGKILLed cannot stop its trainers; this is how the demo
    still leaves nothing running. Returns the pids it found.
    """
    pids = find_stray_trainers(checkpoint_root)
    own_group = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            # Trainers run in sessions of their own; never signal the group we belong to.
            if group == own_group:
                os.kill(pid, signal.SIGKILL)
            else:
                os.killpg(group, signal.SIGKILL)
    return pids
