"""run_exec with real subprocesses, and format_exec_failure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from haru_exec import (
    STDERR_LIMIT,
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

PY = sys.executable

# The child starts a grandchild that would sleep for ten minutes (far past any bound of the
# tests, so only a kill ends it), records its pid, then sleeps too.
SPAWN_GRANDCHILD = """
import pathlib, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1]).write_text(str(grandchild.pid))
time.sleep(600)
"""
# The child starts the same grandchild, then prints without end: only a kill stops it.
PRINT_FOREVER = """
import pathlib, subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1]).write_text(str(grandchild.pid))
line = b"x" * 1023 + b"\\n"
while True:
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
"""
# Generous outer bound: a run_exec that fails to kill would otherwise hang on the open pipes.
OUTER_BOUND_S = 30


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


async def wait_dead(pid: int, *, within: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if not is_running(pid):
            return True
        await asyncio.sleep(0.02)
    return False


@contextlib.contextmanager
def reap_on_failure(pid_file: Path) -> Iterator[None]:
    """Kill a leaked grandchild if the test fails, so no sleeper outlives the suite."""
    try:
        yield
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_stdout_and_exit_code() -> None:
    result = await run_exec([PY, "-c", "print('hello'); print('world')"], timeout=10)
    assert result == ExecResult(
        argv=(PY, "-c", "print('hello'); print('world')"),
        returncode=0,
        stdout="hello\nworld\n",
        stderr="",
    )
    assert result.ok


async def test_nonzero_exit_and_stderr() -> None:
    result = await run_exec(
        [PY, "-c", "import sys; sys.stderr.write('bad thing'); sys.exit(3)"], timeout=10
    )
    assert result.returncode == 3
    assert not result.ok
    assert result.stderr == "bad thing"
    assert result.stdout == ""


async def test_env_is_passed() -> None:
    result = await run_exec(
        [PY, "-c", "import os; print(os.environ.get('HARU_X', 'unset'))"],
        timeout=10,
        env={**os.environ, "HARU_X": "42"},
    )
    assert result.stdout.strip() == "42"


async def test_stdin_is_closed() -> None:
    result = await run_exec([PY, "-c", "import sys; print(repr(sys.stdin.read()))"], timeout=10)
    assert result.stdout.strip() == "''"


async def test_stderr_is_bounded_to_its_tail() -> None:
    script = "import sys; sys.stderr.write('x' * 20000 + 'THE-END'); sys.exit(1)"
    result = await run_exec([PY, "-c", script], timeout=10)
    assert len(result.stderr) == STDERR_LIMIT
    assert result.stderr.endswith("THE-END")


async def test_undecodable_output_is_replaced() -> None:
    script = "import sys; sys.stdout.buffer.write(b'ok\\xff'); sys.stderr.buffer.write(b'\\xfe')"
    result = await run_exec([PY, "-c", script], timeout=10)
    assert result.stdout == "ok\ufffd"
    assert result.stderr == "\ufffd"


async def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with reap_on_failure(pid_file):
        argv = [PY, "-c", SPAWN_GRANDCHILD, str(pid_file)]
        with pytest.raises(ExecTimeoutError) as info:
            await asyncio.wait_for(run_exec(argv, timeout=1.5), OUTER_BOUND_S)
        assert info.value.timeout == 1.5
        assert info.value.argv == tuple(argv)
        assert "1.5 s" in str(info.value)
        assert pid_file.exists(), "the child never started its grandchild"
        assert await wait_dead(int(pid_file.read_text()))


async def test_cancellation_kills_the_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with reap_on_failure(pid_file):
        task = asyncio.create_task(
            run_exec([PY, "-c", SPAWN_GRANDCHILD, str(pid_file)], timeout=60)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not (pid_file.exists() and pid_file.read_text()) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert pid_file.exists()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, OUTER_BOUND_S)
        assert await wait_dead(int(pid_file.read_text()))


async def test_output_past_the_bound_kills_the_process_group(tmp_path: Path) -> None:
    # Were stdout buffered to the end, this child would never finish: the run would end in
    # ExecTimeoutError after 60 s instead of ExecOutputLimitError as soon as 64 KiB are passed.
    pid_file = tmp_path / "grandchild.pid"
    with reap_on_failure(pid_file):
        argv = [PY, "-c", PRINT_FOREVER, str(pid_file)]
        with pytest.raises(ExecOutputLimitError) as info:
            await asyncio.wait_for(
                run_exec(argv, timeout=OUTER_BOUND_S * 2, stdout_limit=64 * 1024), OUTER_BOUND_S
            )
        assert info.value.limit == 64 * 1024
        assert info.value.argv == tuple(argv)
        assert "65536 bytes" in str(info.value)
        assert isinstance(info.value, ExecError)
        assert pid_file.exists(), "the child never started its grandchild"
        assert await wait_dead(int(pid_file.read_text()))


async def test_output_at_the_bound_is_kept() -> None:
    script = "import sys; sys.stdout.write('y' * 5000)"
    result = await run_exec([PY, "-c", script], timeout=10, stdout_limit=5000)
    assert result.stdout == "y" * 5000
    with pytest.raises(ExecOutputLimitError):
        await run_exec([PY, "-c", script], timeout=10, stdout_limit=4999)


async def test_negative_stdout_limit_rejected() -> None:
    with pytest.raises(ValueError, match="stdout_limit"):
        await run_exec([PY, "-c", "pass"], timeout=5, stdout_limit=-1)


def test_kill_process_group_of_a_missing_group() -> None:
    # Reap a real child first so its pid (and group id) is known to be free.
    child = subprocess.Popen([PY, "-c", "pass"], start_new_session=True)
    child.wait()
    assert kill_process_group(child.pid) is False


async def test_kill_process_group_signals_every_member(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with reap_on_failure(pid_file):
        proc = await asyncio.create_subprocess_exec(
            PY, "-c", SPAWN_GRANDCHILD, str(pid_file), start_new_session=True
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not (pid_file.exists() and pid_file.read_text()) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert kill_process_group(proc.pid, signal.SIGTERM) is True
        assert await asyncio.wait_for(proc.wait(), OUTER_BOUND_S) == -signal.SIGTERM
        assert await wait_dead(int(pid_file.read_text()))


async def test_missing_binary_raises_spawn_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-binary")
    with pytest.raises(ExecSpawnError) as info:
        await run_exec([missing, "--help"], timeout=5)
    assert info.value.argv == (missing, "--help")
    assert "no-such-binary" in str(info.value)
    assert isinstance(info.value, ExecError)


async def test_non_executable_file_raises_spawn_error(tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(ExecSpawnError):
        await run_exec([str(script)], timeout=5)


async def test_empty_argv_rejected() -> None:
    with pytest.raises(ValueError, match="argv"):
        await run_exec([], timeout=5)


async def test_run_exec_satisfies_the_exec_protocol() -> None:
    runner: Exec = run_exec
    result = await runner([PY, "-c", "print(1)"], timeout=10)
    assert result.stdout == "1\n"


# ---- format_exec_failure ----


def test_format_exec_failure() -> None:
    result = ExecResult(
        argv=("sky", "launch", "-c", "x"), returncode=2, stdout="", stderr="line one\nline two\n"
    )
    assert (
        format_exec_failure(result) == "`sky launch -c x` exited with status 2: line one line two"
    )


def test_format_exec_failure_without_stderr() -> None:
    result = ExecResult(argv=("true",), returncode=1, stdout="", stderr="  \n")
    assert format_exec_failure(result) == "`true` exited with status 1"


def test_format_exec_failure_is_bounded() -> None:
    result = ExecResult(
        argv=("cmd", *["arg"] * 500), returncode=9, stdout="", stderr="e" * 5000 + " LAST"
    )
    text = format_exec_failure(result, limit=100)
    assert text.endswith("e LAST")
    assert "..." in text
    assert len(text) <= 100 + 200 + 64
    default = format_exec_failure(result)
    assert len(default) <= 1024 + 200 + 64
