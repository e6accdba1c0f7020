"""Errors of haru-driver-skypilot (also raised by haru-driver-skyserve, which reuses them).

Hierarchy::

    SkyDriverError
    ├── InvalidSpecError(ValueError)  (a launch or service spec that cannot be rendered)
    ├── SkyCommandError               (a `sky` command did not succeed; carries its argv)
    │   ├── SkyCliError               (exited non-zero: exit code and bounded stderr)
    │   │   └── SkyVersionMismatchError   (the client and the API server disagree on versions)
    │   ├── SkyTimeoutError           (killed after its time bound)
    │   └── SkyUnavailableError       (could not be started: binary missing or not executable)
    ├── SkyOutputError                (output or SDK record not in the documented shape)
    │   └── UnknownStatusError        (a status outside SkyPilot's documented vocabulary)
    ├── SkySdkError                   (SkyPilot's Python SDK is missing or its call failed)
    └── SkyPreflightError             (`sky` too old, or its API server does not answer)
"""

from __future__ import annotations

from collections.abc import Sequence

from haru_exec import STDERR_LIMIT, ExecResult, format_exec_failure

_EXCERPT_LIMIT = 512


def _excerpt(text: str, limit: int = _EXCERPT_LIMIT) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else "..." + flat[-limit:]


class SkyDriverError(Exception):
    """Root of the exceptions raised by the SkyPilot and SkyServe drivers."""


class InvalidSpecError(SkyDriverError, ValueError):
    """A spec that SkyPilot would reject, or that would not do what its fields say."""


class SkyCommandError(SkyDriverError):
    """A ``sky`` command did not succeed.

    Attributes:
        argv: The full command line that was run (no shell; secrets never appear in it
            because specs travel in a YAML file).
    """

    def __init__(self, message: str, *, argv: Sequence[str]) -> None:
        super().__init__(message)
        self.argv = tuple(argv)


class SkyCliError(SkyCommandError):
    """``sky`` exited with a non-zero status.

    Attributes:
        returncode: The exit status.
        stderr: The last :data:`haru_protocol.STDERR_LIMIT` characters of stderr.
        stdout_tail: The last :data:`haru_protocol.STDERR_LIMIT` characters of stdout
            (SkyPilot prints some failures, such as API-server trouble, to stdout).
    """

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str],
        returncode: int,
        stderr: str,
        stdout_tail: str = "",
    ) -> None:
        super().__init__(message, argv=argv)
        self.returncode = returncode
        self.stderr = stderr[-STDERR_LIMIT:]
        self.stdout_tail = stdout_tail[-STDERR_LIMIT:]

    @classmethod
    def from_result(cls, result: ExecResult) -> SkyCliError:
        """Build the error for a finished command that exited non-zero."""
        message = format_exec_failure(result)
        if not result.stderr.strip() and result.stdout.strip():
            message += f"; stdout: {_excerpt(result.stdout, 1024)}"
        return cls(
            message,
            argv=result.argv,
            returncode=result.returncode,
            stderr=result.stderr,
            stdout_tail=result.stdout,
        )


class SkyTimeoutError(SkyCommandError):
    """``sky`` ran past its time bound and was killed (its process group with it).

    Attributes:
        timeout: The bound, in seconds.
    """

    def __init__(self, message: str, *, argv: Sequence[str], timeout: float) -> None:
        super().__init__(message, argv=argv)
        self.timeout = timeout


class SkyUnavailableError(SkyCommandError):
    """``sky`` could not be started (not installed, not on ``PATH``, not executable)."""


class SkyOutputError(SkyDriverError):
    """What SkyPilot printed or returned is not in the shape its documentation gives.

    Attributes:
        argv: The command whose output it was, or ``None`` for an SDK record.
        excerpt: A bounded, whitespace-collapsed excerpt of the offending output.
    """

    def __init__(self, message: str, *, argv: Sequence[str] | None, output: str = "") -> None:
        super().__init__(message)
        self.argv = None if argv is None else tuple(argv)
        self.excerpt = _excerpt(output)


class UnknownStatusError(SkyOutputError):
    """A cluster or service status outside SkyPilot's documented vocabulary.

    Attributes:
        status: The status as SkyPilot reported it.
    """

    def __init__(
        self, message: str, *, status: str, argv: Sequence[str] | None, output: str = ""
    ) -> None:
        super().__init__(message, argv=argv, output=output)
        self.status = status


class SkySdkError(SkyDriverError):
    """SkyPilot's Python SDK is not installed, or one of its calls failed or timed out."""


class SkyVersionMismatchError(SkyCliError):
    """The ``sky`` client and its API server run incompatible versions.

    SkyPilot raises ``sky.exceptions.APIVersionMismatchError`` from every command
    (``sky/server/common.py``, ``check_server_healthy``); nothing works until the server is
    restarted with the client's version (``sky api stop``, then any ``sky`` call).
    """


class SkyPreflightError(SkyDriverError):
    """``sky`` cannot be used: missing, older than the minimum, or its API server is down."""
