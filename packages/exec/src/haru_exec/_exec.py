"""The async exec boundary: run an argv (never a shell) with a time bound and an output bound.

Hierarchy::

    ExecError                  a command could not be run to completion
    ├── ExecSpawnError         missing binary, no permission
    ├── ExecTimeoutError       killed after its time bound
    └── ExecOutputLimitError   killed after printing more than its stdout bound
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

STDERR_LIMIT = 4096
"""Bytes of stderr kept (the tail): enough to explain a failure, bounded for logs."""

STDOUT_LIMIT = 16 * 1024 * 1024
"""Default bound of stdout; more is a failure of the command's contract."""

_CHUNK = 64 * 1024


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


class ExecError(Exception):
    """A command could not be run to completion (root of haru-exec's errors)."""

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


class ExecOutputLimitError(ExecError):
    """The command printed more than its stdout bound and was killed."""

    def __init__(self, message: str, *, argv: Sequence[str], limit: int) -> None:
        super().__init__(message, argv=argv)
        self.limit = limit


class Exec(Protocol):
    """Signature of :func:`run_exec`, so callers can inject a fake runner."""

    async def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult: ...


def kill_process_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to process group ``pgid``; ``False`` when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def _read_bounded(stream: asyncio.StreamReader, limit: int, argv: tuple[str, ...]) -> bytes:
    """Read ``stream`` to its end, raising as soon as more than ``limit`` bytes arrived."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.read(_CHUNK):
        size += len(chunk)
        if size > limit:
            raise ExecOutputLimitError(
                f"{argv[0]!r} wrote more than {limit} bytes to stdout", argv=argv, limit=limit
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Read ``stream`` to its end, keeping only its last ``limit`` bytes."""
    tail = b""
    while chunk := await stream.read(_CHUNK):
        tail = (tail + chunk)[-limit:]
    return tail


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(_CHUNK):
        pass


async def run_exec(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    stdout_limit: int = STDOUT_LIMIT,
) -> ExecResult:
    """Run ``argv`` without a shell and wait at most ``timeout`` seconds.

    The child runs in its own session so that, on timeout, cancellation or too much output,
    its whole process group is killed and nothing it spawned survives. stdout is read as it
    arrives: the group is killed as soon as it passes ``stdout_limit`` bytes.

    Raises:
        ExecSpawnError: the binary is missing or not executable.
        ExecTimeoutError: the command did not finish in time (it has been killed).
        ExecOutputLimitError: the command printed more than ``stdout_limit`` bytes to stdout
            (it has been killed).
        ValueError: ``argv`` is empty or ``stdout_limit`` is negative.
    """
    args = tuple(argv)
    if not args:
        raise ValueError("argv must not be empty")
    if stdout_limit < 0:
        raise ValueError("stdout_limit must not be negative")
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
    assert proc.stdout is not None  # noqa: S101  (PIPE was asked for)
    assert proc.stderr is not None  # noqa: S101
    stderr_task = asyncio.create_task(_read_tail(proc.stderr, STDERR_LIMIT))
    try:
        async with asyncio.timeout(timeout):
            stdout = await _read_bounded(proc.stdout, stdout_limit, args)
            stderr = await stderr_task
            returncode = await proc.wait()
    except BaseException as exc:
        kill_process_group(proc.pid)
        stderr_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stderr_task
        # asyncio's wait() returns only once every pipe reported EOF, and a reader whose buffer
        # is full stops reading: drain both (the group is dead, so EOF comes promptly).
        await _drain(proc.stdout)
        await _drain(proc.stderr)
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise ExecTimeoutError(
                f"{args[0]!r} did not finish within {timeout:g} s", argv=args, timeout=timeout
            ) from None
        raise
    return ExecResult(
        argv=args,
        returncode=returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
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
