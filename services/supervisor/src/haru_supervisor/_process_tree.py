"""The processes of a training run: the trainer and every descendant, found and signalled.

A descendant may leave the trainer's session and process group (``setsid``, a daemonizing
double fork), so :class:`ProcessTracker` follows them: the supervisor is a child subreaper
(:func:`become_subreaper`: an orphan is reparented to it, never to init); every refresh lists
the host's processes through psutil and keeps the ones whose parent is tracked, that are in the
trainer's group, or that are orphans adopted by the supervisor carrying the slot's marks in
their environment. A process is its pid AND start time, so a recycled pid is never mistaken
for it; signals go to the group and to each tracked process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import psutil

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Proc:
    """What tracking needs of one process (read through psutil)."""

    process: psutil.Process
    """Equal only to the same process: psutil compares pid AND start time since boot, so a
    recycled pid never matches (and no clock step moves the start time)."""
    ppid: int
    pgid: int
    zombie: bool


def _read(process: psutil.Process) -> _Proc | None:
    try:
        with process.oneshot():
            ppid = process.ppid()
            zombie = process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return None  # exited while we looked
    try:
        pgid = os.getpgid(process.pid)
    except OSError:
        pgid = -1  # a zombie may already have left its group
    return _Proc(process=process, ppid=ppid, pgid=pgid, zombie=zombie)


def _read_pid(pid: int) -> _Proc | None:
    try:
        return _read(psutil.Process(pid))
    except psutil.Error:
        return None


def _scan() -> dict[int, _Proc]:
    """Every process of the host (of this pid namespace)."""
    procs: dict[int, _Proc] = {}
    for process in psutil.process_iter():
        proc = _read(process)
        if proc is not None:
            procs[process.pid] = proc
    return procs


def _environ_has(pid: int, marks: Mapping[str, str]) -> bool:
    """Whether ``pid``'s initial environment holds every ``NAME=value`` of ``marks``."""
    try:
        environ = psutil.Process(pid).environ()
    except psutil.Error:
        return False
    return all(environ.get(name) == value for name, value in marks.items())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # the group exists (a member changed its credentials)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _signal_process(process: psutil.Process, sig: signal.Signals) -> None:
    """Signal ``process`` only if its pid still names it (not a process that reused it).

    Through a pidfd where the platform has one: once it is open, the pid cannot be recycled
    under it, so a signal never reaches an unrelated process that reused the number.
    """
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:
        if process.is_running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)
        return
    try:
        fd = pidfd_open(process.pid)
    except OSError:
        return  # gone
    try:
        if process.is_running():
            with contextlib.suppress(ProcessLookupError):
                send(fd, sig)
    finally:
        os.close(fd)


def _reap(pid: int) -> None:
    """Collect an adopted orphan's exit status so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


_PR_SET_CHILD_SUBREAPER: Final = 36
_subreaper: bool | None = None


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux ``prctl``; once).

    Through ``ctypes``: neither psutil nor the standard library wraps ``prctl``.

    A trainer's child whose parent exits is then reparented to the supervisor instead of
    init, so a process that left the trainer's session (``setsid``) before the supervisor saw
    it is still found among the supervisor's own children and can be stopped.

    Returns:
        Whether the supervisor is a subreaper (False off Linux or when prctl failed).
    """
    global _subreaper  # one process-wide attribute, set once
    if _subreaper is not None:
        return _subreaper
    _subreaper = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
                _subreaper = True
            else:
                logger.warning(
                    "prctl(PR_SET_CHILD_SUBREAPER) failed: %s", os.strerror(ctypes.get_errno())
                )
        except (OSError, AttributeError) as exc:
            logger.warning("prctl(PR_SET_CHILD_SUBREAPER) unavailable: %s", exc)
    return _subreaper


class ProcessTracker:
    """The processes of one run: the trainer and every descendant seen so far."""

    def __init__(self, leader: int, *, marks: Mapping[str, str]) -> None:
        self._leader = leader
        self._marks = marks
        self._self_pid = os.getpid()
        self._lock = threading.Lock()
        self._linux = psutil.LINUX
        proc = _read_pid(leader) if self._linux else None
        self._members: dict[int, psutil.Process] = {} if proc is None else {leader: proc.process}

    def refresh(self) -> tuple[int, ...]:
        """List the processes (blocking: run it in a thread); the run's live processes, sorted."""
        if not self._linux:
            return (self._leader,) if _group_alive(self._leader) else ()
        procs = _scan()
        with self._lock:
            members = self._members
            for pid, member in list(members.items()):
                proc = procs.get(pid)
                if proc is None or proc.process != member:
                    del members[pid]
                elif proc.zombie:
                    del members[pid]
                    # The trainer is reaped by asyncio; an adopted orphan only by us.
                    if pid != self._leader and proc.ppid == self._self_pid:
                        _reap(pid)
            grew = True
            while grew:
                grew = False
                for pid, proc in procs.items():
                    if pid in members or proc.zombie:
                        continue
                    if (
                        proc.ppid in members
                        or proc.pgid == self._leader
                        or (proc.ppid == self._self_pid and _environ_has(pid, self._marks))
                    ):
                        members[pid] = proc.process
                        grew = True
            return tuple(sorted(members))

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the trainer's group and to every tracked process."""
        _signal_group(self._leader, sig)
        with self._lock:
            members = list(self._members.items())
        for _pid, member in members:
            _signal_process(member, sig)
