"""The async exec boundary: run an argv (never a shell) with a time bound.

Drivers (``sky``) and the supervisor (``nvidia-smi``) run external commands through this one
function, and tests inject a fake with the same signature (:class:`Exec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from haru_protocol._errors import HaruProtocolError

STDERR_LIMIT = 4096
"""Bytes of stderr kept (the tail): enough to explain a failure, bounded for logs."""

STDOUT_LIMIT = 16 * 1024 * 1024
"""Bytes of stdout kept; more is a failure of the command's contract."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What a finished command produced."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    """The last :data:`STDERR_LIMIT` bytes of stderr, decoded leniently."""

    @property
    def ok(self) -> bool:
        """Whether the command exited with status 0."""
        return self.returncode == 0


class ExecError(HaruProtocolError):
    """A command could not be run to completion."""

    def __init__(self, message: str, *, argv: Sequence[str]) -> None:
        super().__init__(message)
        self.argv = tuple(argv)


class ExecSpawnError(ExecError):
    """The command could not start (missing binary, no permission)."""


class ExecTimeoutError(ExecError):
    """The command ran past its time bound and was killed."""

    def __init__(self, message: str, *, argv: Sequence[str], timeout: float) -> None:
        super().__init__(message, argv=argv)
        self.timeout = timeout


class Exec(Protocol):
    """Signature of :func:`run_exec`, so callers can inject a fake runner."""

    async def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult: ...


def _tail(data: bytes, limit: int) -> str:
    return data[-limit:].decode("utf-8", errors="replace")


async def run_exec(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> ExecResult:
    """Run ``argv`` without a shell and wait at most ``timeout`` seconds.

    The child runs in its own session so that, on timeout, its whole process group is killed
    and nothing it spawned survives.

    Raises:
        ExecSpawnError: the binary is missing or not executable.
        ExecTimeoutError: the command did not finish in time (it has been killed).
        ValueError: ``argv`` is empty.
    """
    args = tuple(argv)
    if not args:
        raise ValueError("argv must not be empty")
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        raise ExecSpawnError(f"cannot run {args[0]!r}: {exc.strerror or exc}", argv=args) from exc
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise ExecTimeoutError(
            f"{args[0]!r} did not finish within {timeout:g} s", argv=args, timeout=timeout
        ) from None
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if len(stdout) > STDOUT_LIMIT:
        raise ExecError(f"{args[0]!r} wrote more than {STDOUT_LIMIT} bytes to stdout", argv=args)
    return ExecResult(
        argv=args,
        returncode=proc.returncode if proc.returncode is not None else -1,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=_tail(stderr, STDERR_LIMIT),
    )


def format_exec_failure(result: ExecResult, *, limit: int = 1024) -> str:
    """One bounded line describing a failed command: argv, exit code, last stderr line(s)."""
    stderr = " ".join(result.stderr.split())
    if len(stderr) > limit:
        stderr = "..." + stderr[-limit:]
    shown = " ".join(result.argv)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    detail = f": {stderr}" if stderr else ""
    return f"`{shown}` exited with status {result.returncode}{detail}"
