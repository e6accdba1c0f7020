"""Haru's subprocess boundary: run an argv (never a shell) with a time bound and an output bound.

Drivers (``sky``) and the supervisor (``nvidia-smi``) run external commands through
:func:`run_exec`, and tests inject a fake with the same signature (:class:`Exec`). Standard
library only.
"""

from haru_exec._exec import (
    STDERR_LIMIT,
    STDOUT_LIMIT,
    Exec,
    ExecError,
    ExecOutputLimitError,
    ExecResult,
    ExecSpawnError,
    ExecTimeoutError,
    format_exec_failure,
    kill_process_group,
    run_exec,
)

__all__ = (
    "STDERR_LIMIT",
    "STDOUT_LIMIT",
    "Exec",
    "ExecError",
    "ExecOutputLimitError",
    "ExecResult",
    "ExecSpawnError",
    "ExecTimeoutError",
    "format_exec_failure",
    "kill_process_group",
    "run_exec",
)
