"""Training runs: one trainer process group per training slot (SPEC 6.5).

A run is ``idle``, ``running`` or ``stopping``. Its trainer runs in its own session, so its
process group holds the trainer and everything it spawned; every signal goes to the whole
group, and a run is idle again only once no process of that group is alive. That is what lets
a promotion trust that the training VRAM is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Final

from haru_protocol import SupervisorTrainingSlot, TrainingRunState, TrainingSlotStatus

from haru_supervisor._errors import ShuttingDownError, TrainingStartError
from haru_supervisor._settings import CHECKPOINT_DIR_VAR, GPU_INDEX_VAR

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Monotonic seconds; injected so tests control deadlines."""

DEFAULT_POLL_S: Final = 0.05
"""How often a run checks whether the rest of its process group is gone."""

KILL_WAIT_S: Final = 10.0
"""After SIGKILL, how long a process may linger (uninterruptible I/O) before it is logged."""

_PROC: Final = Path("/proc")


def _group_members(pgid: int) -> tuple[int, ...]:
    """Live (non-zombie) processes of process group ``pgid``, sorted.

    Linux lists them from ``/proc``; elsewhere the group's id stands for the group while any
    member exists. Zombies are left out: they hold no memory, and when the supervisor runs as
    PID 1 of a container nothing may ever reap them.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return ()
    except PermissionError:
        pass  # the group exists (a member changed its credentials)
    if not (_PROC / "self" / "stat").exists():
        return (pgid,)
    members: list[int] = []
    with contextlib.suppress(OSError), os.scandir(_PROC) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_bytes()
            except OSError:
                continue  # exited while we looked
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat.rpartition(b")")[2].split()
            if (
                len(fields) >= 3
                and fields[2] == str(pgid).encode()
                and fields[0] not in (b"Z", b"X")
            ):
                members.append(int(entry.name))
    return tuple(sorted(members))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class TrainingRun:
    """The run of one training slot.

    ``start`` is idempotent (a no-op unless idle); ``stop`` sends SIGTERM to the whole process
    group now and SIGKILL when the grace expires; a later ``stop`` may only bring the kill
    deadline closer. A trainer that exits on its own returns the run to idle.
    """

    def __init__(
        self,
        slot: SupervisorTrainingSlot,
        *,
        base_env: Mapping[str, str],
        clock: Clock = time.monotonic,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        """Create an idle run.

        Args:
            slot: The training slot (command, GPU, checkpoint directory).
            base_env: The environment the trainer inherits, secrets already removed.
            clock: Monotonic seconds, for the kill deadline.
            poll_s: How often to check for surviving group members.
        """
        self._slot = slot
        self._env = {
            **base_env,
            CHECKPOINT_DIR_VAR: slot.checkpoint_dir,
            GPU_INDEX_VAR: str(slot.gpu_index),
        }
        self._clock = clock
        self._poll_s = poll_s
        self._lock = asyncio.Lock()
        self._state = TrainingRunState.IDLE
        self._pgid: int | None = None
        self._kill_deadline: float | None = None
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def gpu_index(self) -> int:
        """The slot's GPU."""
        return self._slot.gpu_index

    @property
    def state(self) -> TrainingRunState:
        """The run's state."""
        return self._state

    @property
    def kill_deadline(self) -> float | None:
        """When SIGKILL is due (clock seconds) while stopping; None otherwise."""
        return self._kill_deadline if self._state is TrainingRunState.STOPPING else None

    @property
    def environment(self) -> Mapping[str, str]:
        """The exact environment the trainer is started with."""
        return dict(self._env)

    async def pids(self) -> tuple[int, ...]:
        """The live processes of the run's group; empty unless one is alive."""
        pgid = self._pgid
        if pgid is None:
            return ()
        return await asyncio.to_thread(_group_members, pgid)

    async def status(self) -> TrainingSlotStatus:
        """The run as ``GET /v1/training/status`` reports it."""
        state = self._state
        pids = await self.pids()
        return TrainingSlotStatus(gpu_index=self.gpu_index, state=state, pids=pids)

    async def start(self) -> bool:
        """Spawn the trainer unless the run is already running or stopping.

        Returns:
            True when a trainer was spawned, False when the run was not idle.

        Raises:
            TrainingStartError: The command could not be spawned; the run stays idle.
        """
        async with self._lock:
            if self._state is not TrainingRunState.IDLE:
                return False
            command = self._slot.command
            try:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    env=self._env,
                    start_new_session=True,
                )
            except (OSError, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise TrainingStartError(
                    self.gpu_index, f"cannot run {command[0][:200]!r}: {reason}"
                ) from exc
            self._state = TrainingRunState.RUNNING
            self._pgid = process.pid
            self._kill_deadline = None
            self._idle.clear()
            self._changed.clear()
            self._watcher = asyncio.create_task(
                self._watch(process), name=f"training-gpu{self.gpu_index}"
            )
            logger.info("training on GPU %d started (pid %d)", self.gpu_index, process.pid)
            return True

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group now (when running) and SIGKILL it ``grace_s`` from now.

        While already stopping, only a closer deadline is taken; no second SIGTERM is sent.
        Stopping an idle run does nothing.
        """
        async with self._lock:
            if self._state is TrainingRunState.IDLE or self._pgid is None:
                return
            deadline = self._clock() + max(0.0, grace_s)
            if self._state is TrainingRunState.RUNNING:
                self._state = TrainingRunState.STOPPING
                self._kill_deadline = deadline
                logger.info(
                    "training on GPU %d: SIGTERM to group %d, SIGKILL in %.1f s",
                    self.gpu_index,
                    self._pgid,
                    grace_s,
                )
                _signal_group(self._pgid, signal.SIGTERM)
            elif self._kill_deadline is None or deadline < self._kill_deadline:
                self._kill_deadline = deadline
            self._changed.set()

    async def wait_idle(self) -> None:
        """Return once the run is idle (no process of its group alive)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel the watcher (after :meth:`stop` and a bounded wait failed to end the run)."""
        watcher = self._watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        pgid = process.pid
        leader = asyncio.create_task(process.wait(), name=f"training-gpu{self.gpu_index}-wait")
        killed_at: float | None = None
        lingering_logged = False
        try:
            while True:
                # Cleared before the state is read, so a stop() landing during the await
                # below is seen by the next wait instead of lost.
                self._changed.clear()
                leader_done = leader.done()
                if leader_done and not await asyncio.to_thread(_group_members, pgid):
                    break
                now = self._clock()
                if leader_done and self._state is TrainingRunState.RUNNING:
                    # The trainer exited by itself but left processes in its group: nothing
                    # would ever stop them, and they may hold the GPU.
                    logger.warning(
                        "training on GPU %d: trainer exited with status %s but left processes "
                        "in its group; killing them",
                        self.gpu_index,
                        process.returncode,
                    )
                    self._state = TrainingRunState.STOPPING
                    self._kill_deadline = now
                deadline = self._kill_deadline
                if (
                    self._state is TrainingRunState.STOPPING
                    and deadline is not None
                    and now >= deadline
                ):
                    # Repeated while anything survives: a process forked during the
                    # first kill can miss it.
                    _signal_group(pgid, signal.SIGKILL)
                    if killed_at is None:
                        killed_at = now
                        logger.warning(
                            "training on GPU %d: grace expired, SIGKILL to group %d",
                            self.gpu_index,
                            pgid,
                        )
                    elif not lingering_logged and now - killed_at > KILL_WAIT_S:
                        lingering_logged = True
                        logger.error(
                            "training on GPU %d: processes of group %d survive SIGKILL "
                            "(uninterruptible?); still waiting",
                            self.gpu_index,
                            pgid,
                        )
                await self._wait_for_change(leader, now=now)
            self._log_exit(process.returncode)
        finally:
            if not leader.done():
                leader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await leader
            self._state = TrainingRunState.IDLE
            self._kill_deadline = None
            self._pgid = None
            self._idle.set()

    async def _wait_for_change(self, leader: asyncio.Task[int], *, now: float) -> None:
        """Sleep until the leader exits, a stop changes the deadline, or a poll is due."""
        timeout = math.inf
        if leader.done():
            timeout = self._poll_s
        deadline = self._kill_deadline
        if self._state is TrainingRunState.STOPPING and deadline is not None:
            timeout = min(timeout, self._poll_s if now >= deadline else deadline - now)
        changed = asyncio.create_task(self._changed.wait())
        try:
            await asyncio.wait(
                {leader, changed} if not leader.done() else {changed},
                timeout=None if math.isinf(timeout) else timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            changed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await changed

    def _log_exit(self, returncode: int | None) -> None:
        if returncode is not None and returncode < 0:
            with contextlib.suppress(ValueError):
                logger.info(
                    "training on GPU %d ended by %s",
                    self.gpu_index,
                    signal.Signals(-returncode).name,
                )
                return
        level = logging.INFO if returncode == 0 else logging.WARNING
        logger.log(level, "training on GPU %d exited with status %s", self.gpu_index, returncode)


class TrainingRuns:
    """Every training slot's run, plus the shutdown latch that refuses new starts."""

    def __init__(
        self,
        slots: Iterable[SupervisorTrainingSlot],
        *,
        base_env: Mapping[str, str],
        clock: Clock = time.monotonic,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        """Create idle runs, one per slot, in config order."""
        self._runs = tuple(
            TrainingRun(slot, base_env=base_env, clock=clock, poll_s=poll_s) for slot in slots
        )
        self._refusing = False

    @property
    def runs(self) -> tuple[TrainingRun, ...]:
        """The runs, in config order."""
        return self._runs

    @property
    def refusing_starts(self) -> bool:
        """Whether shutdown began (no run may start any more)."""
        return self._refusing

    def refuse_starts(self) -> None:
        """Refuse every later start (the first step of shutdown)."""
        self._refusing = True

    def by_gpu(self, gpu_index: int) -> TrainingRun | None:
        """The run on ``gpu_index``, if any."""
        return next((run for run in self._runs if run.gpu_index == gpu_index), None)

    async def start_all(self) -> list[TrainingStartError]:
        """Start every idle run; the failures, one per slot that could not spawn.

        Raises:
            ShuttingDownError: Shutdown began.
        """
        if self._refusing:
            raise ShuttingDownError("the supervisor is shutting down")
        failures: list[TrainingStartError] = []
        for run in self._runs:
            # Checked again per run: shutdown may begin while an earlier spawn awaits.
            if self._refusing:
                raise ShuttingDownError("the supervisor is shutting down")
            try:
                await run.start()
            except TrainingStartError as exc:
                failures.append(exc)
        for failure in failures:
            logger.error("training could not start on %s", failure)
        return failures

    async def stop_all(self, grace_s: float) -> None:
        """Stop every run with the same grace (see :meth:`TrainingRun.stop`)."""
        for run in self._runs:
            await run.stop(grace_s)

    async def statuses(self) -> tuple[TrainingSlotStatus, ...]:
        """Every run's status, in config order."""
        return tuple(await asyncio.gather(*(run.status() for run in self._runs)))

    async def shutdown(self, grace_s: float) -> bool:
        """Refuse starts, stop every run, and wait until each is idle (bounded).

        Returns:
            True when every run ended; False when a process survived SIGKILL past
            :data:`KILL_WAIT_S` (logged; the watchers are then cancelled).
        """
        self.refuse_starts()
        await self.stop_all(grace_s)
        ended = True
        try:
            async with asyncio.timeout(max(0.0, grace_s) + KILL_WAIT_S):
                await asyncio.gather(*(run.wait_idle() for run in self._runs))
        except TimeoutError:
            ended = False
        if not ended:
            survivors = [
                run.gpu_index for run in self._runs if run.state is not TrainingRunState.IDLE
            ]
            logger.error("training runs on GPU(s) %s did not end after SIGKILL", survivors)
            for run in self._runs:
                await run.close()
        return ended
