"""Training runs with real child processes and real signals."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from haru_protocol import SupervisorTrainingSlot, TrainingRunState
from haru_sim import read_trainer_checkpoint
from haru_supervisor.api import (
    SettingsError,
    ShuttingDownError,
    TrainingRun,
    TrainingRuns,
    TrainingStartError,
    trainer_base_env,
)

Command = Callable[..., tuple[str, ...]]


def _slot(
    command: tuple[str, ...], checkpoint_dir: Path, gpu_index: int = 1
) -> SupervisorTrainingSlot:
    return SupervisorTrainingSlot(
        gpu_index=gpu_index, command=command, checkpoint_dir=str(checkpoint_dir)
    )


def _run(command: tuple[str, ...], checkpoint_dir: Path, **kwargs: Any) -> TrainingRun:
    return TrainingRun(
        _slot(command, checkpoint_dir), base_env=dict(os.environ), poll_s=0.02, **kwargs
    )


def _state(run: TrainingRun) -> TrainingRunState:
    # A call, so the type checker does not narrow the state across awaits.
    return run.state


def _ready_pids(directory: Path) -> list[int] | None:
    try:
        pids: list[int] = json.loads((directory / "ready.json").read_text())
    except FileNotFoundError:
        return None
    return pids


async def test_a_trainer_that_exits_on_sigterm(
    tmp_path: Path, sim_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    run = _run(sim_trainer(), tmp_path)
    assert _state(run) is TrainingRunState.IDLE
    assert await run.pids() == ()
    assert await run.start() is True
    assert _state(run) is TrainingRunState.RUNNING
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    (pid,) = await run.pids()
    started = time.monotonic()
    await run.stop(30.0)
    assert _state(run) is TrainingRunState.STOPPING
    await run.wait_idle()
    # It ended on SIGTERM, long before the 30 s grace.
    assert time.monotonic() - started < 10
    assert _state(run) is TrainingRunState.IDLE
    assert await run.pids() == ()
    assert not alive(pid)
    checkpoint = read_trainer_checkpoint(tmp_path)
    assert checkpoint is not None
    assert checkpoint.gpu_index == 1
    stop = (await run.status()).last_stop
    assert stop is not None
    assert (stop.killed, stop.grace_ms) == (False, 30_000)
    # A new start forgets the last stop.
    assert await run.start() is True
    assert (await run.status()).last_stop is None
    await run.stop(30.0)
    await run.wait_idle()


async def test_a_trainer_ignoring_sigterm_is_killed_at_the_grace(
    tmp_path: Path,
    sim_trainer: Command,
    wait_for: Any,
    alive: Callable[[int], bool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="haru_supervisor")
    run = _run(sim_trainer("--ignore-sigterm"), tmp_path)
    await run.start()
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    (pid,) = await run.pids()
    await run.stop(0.4)
    deadline = run.kill_deadline
    assert deadline is not None
    # SIGTERM was delivered and ignored: still alive and stopping until the deadline.
    assert alive(pid)
    assert _state(run) is TrainingRunState.STOPPING
    await run.wait_idle()
    assert time.monotonic() >= deadline
    assert not alive(pid)
    assert "SIGKILL to group" in caplog.text
    assert "ended by SIGKILL" in caplog.text
    stop = (await run.status()).last_stop
    assert stop is not None
    assert (stop.killed, stop.grace_ms) == (True, 400)
    assert stop.stop_ms >= 400


async def test_the_whole_process_group_dies(
    tmp_path: Path, fake_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    # The trainer exits on SIGTERM; its grandchild ignores SIGTERM and must be SIGKILLed.
    run = _run(fake_trainer("--grandchild"), tmp_path)
    await run.start()
    await wait_for(lambda: _ready_pids(tmp_path) is not None)
    pids = _ready_pids(tmp_path)
    assert pids is not None
    assert len(pids) == 2
    await wait_for(lambda: _pids_reported(run, pids))
    await run.stop(10.0)  # room to observe the grandchild before its SIGKILL, even under load
    await wait_for(lambda: not alive(pids[0]))
    # The leader is gone but the grandchild holds the run in `stopping`.
    assert alive(pids[1])
    assert _state(run) is TrainingRunState.STOPPING
    assert await run.pids() == (pids[1],)
    await run.wait_idle()
    assert not any(alive(pid) for pid in pids)
    assert await run.pids() == ()


async def test_a_grandchild_that_left_the_session_is_stopped_too(
    tmp_path: Path, fake_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    # The grandchild calls setsid() (a process group of its own, out of reach of killpg on
    # the trainer's group) and ignores SIGTERM: stop must still leave no process.
    run = _run(fake_trainer("--escaped-grandchild"), tmp_path)
    await run.start()
    await wait_for(lambda: _ready_pids(tmp_path) is not None)
    pids = _ready_pids(tmp_path)
    assert pids is not None
    trainer, grandchild = pids
    assert os.getpgid(grandchild) == grandchild != trainer
    await wait_for(lambda: _pids_reported(run, pids))
    await run.stop(0.3)
    await run.wait_idle()
    assert not alive(trainer)
    assert not alive(grandchild)
    assert _state(run) is TrainingRunState.IDLE
    assert await run.pids() == ()


async def test_an_escaped_grandchild_of_a_finished_trainer_is_found_and_killed(
    tmp_path: Path,
    fake_trainer: Command,
    alive: Callable[[int], bool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The trainer exits right away: its setsid() grandchild is orphaned before any poll saw
    # it. The supervisor adopts it (child subreaper) and recognises it by the slot's marks.
    caplog.set_level(logging.INFO, logger="haru_supervisor")
    run = TrainingRun(
        _slot(fake_trainer("--escaped-grandchild", "--exit-after-ms", "0"), tmp_path),
        base_env=dict(os.environ),
        poll_s=0.02,
        track_s=60.0,
    )
    await run.start()
    await run.wait_idle()
    pids = _ready_pids(tmp_path)
    assert pids is not None
    assert not any(alive(pid) for pid in pids)
    assert "left processes" in caplog.text


async def _pids_reported(run: TrainingRun, pids: list[int]) -> bool:
    return set(await run.pids()) == set(pids)


async def test_sim_trainer_with_a_child_stops_cleanly(
    tmp_path: Path, sim_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    run = _run(sim_trainer("--spawn-child"), tmp_path)
    await run.start()

    async def two_pids() -> bool:
        return len(await run.pids()) == 2

    await wait_for(two_pids)
    pids = await run.pids()
    await run.stop(5.0)
    await run.wait_idle()
    assert not any(alive(pid) for pid in pids)


async def test_a_missing_binary_leaves_the_run_idle(tmp_path: Path) -> None:
    run = _run((str(tmp_path / "no-such-trainer"), "--flag"), tmp_path)
    with pytest.raises(TrainingStartError, match="No such file or directory") as caught:
        await run.start()
    assert caught.value.gpu_index == 1
    assert _state(run) is TrainingRunState.IDLE
    assert await run.pids() == ()
    await run.stop(1.0)  # a no-op on an idle run
    assert _state(run) is TrainingRunState.IDLE


async def test_a_non_executable_file_leaves_the_run_idle(tmp_path: Path) -> None:
    script = tmp_path / "trainer.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    run = _run((str(script),), tmp_path)
    with pytest.raises(TrainingStartError, match="Permission denied"):
        await run.start()
    assert _state(run) is TrainingRunState.IDLE


async def test_the_environment_has_no_secret_and_exactly_two_additions(
    tmp_path: Path, fake_trainer: Command, wait_for: Any
) -> None:
    token = "s3cret-token-value"
    parent = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LC_ALL": "C.UTF-8",
        "KEEP_ME": "yes",
        "HARU_SUPERVISOR_TOKEN": token,
        "SAME_SECRET_ELSEWHERE": token,
        "MENTIONS_IT": f"https://user:{token}@example.invalid/",
        "HARU_CHECKPOINT_DIR": "/stale",
        "HARU_GPU_INDEX": "7",
    }
    run = TrainingRun(
        _slot(fake_trainer(), tmp_path, gpu_index=3),
        base_env=trainer_base_env(parent, token),
        poll_s=0.02,
    )
    await run.start()
    await wait_for(lambda: _ready_pids(tmp_path) is not None)
    env = json.loads((tmp_path / "env.json").read_text())
    await run.stop(5.0)
    await run.wait_idle()
    assert env == {
        "PATH": parent["PATH"],
        "LC_ALL": "C.UTF-8",
        "KEEP_ME": "yes",
        # Only exact matches go: a value that merely contains the token is the operator's.
        "MENTIONS_IT": parent["MENTIONS_IT"],
        "HARU_CHECKPOINT_DIR": str(tmp_path),
        "HARU_GPU_INDEX": "3",
    }


async def test_a_second_stop_only_tightens_the_deadline(
    tmp_path: Path, sim_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    run = _run(sim_trainer("--ignore-sigterm"), tmp_path)
    await run.start()
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    (pid,) = await run.pids()
    await run.stop(60.0)
    first = run.kill_deadline
    assert first is not None
    await run.stop(120.0)  # looser: ignored
    assert run.kill_deadline == first
    started = time.monotonic()
    await run.stop(0.2)  # tighter: taken
    second = run.kill_deadline
    assert second is not None
    assert second < first
    await run.wait_idle()
    assert time.monotonic() - started < 10  # killed at the tightened deadline, not after 60 s
    assert not alive(pid)


async def test_start_is_idempotent_and_a_run_can_start_again(
    tmp_path: Path, sim_trainer: Command, wait_for: Any
) -> None:
    run = _run(sim_trainer(), tmp_path)
    assert await run.start() is True
    assert await run.start() is False
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    (pid,) = await run.pids()
    await run.stop(5.0)
    assert await run.start() is False  # stopping: still a no-op
    await run.wait_idle()
    assert await run.start() is True
    await wait_for(lambda: _has_new_pid(run, pid))
    await run.stop(5.0)
    await run.wait_idle()


async def _has_new_pid(run: TrainingRun, old: int) -> bool:
    pids = await run.pids()
    return bool(pids) and pids != (old,)


async def test_a_trainer_exiting_on_its_own_returns_to_idle(
    tmp_path: Path, sim_trainer: Command, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="haru_supervisor")
    run = _run(sim_trainer("--max-steps", "3"), tmp_path)
    await run.start()
    await run.wait_idle()
    assert _state(run) is TrainingRunState.IDLE
    assert await run.pids() == ()
    assert "exited with status 0" in caplog.text


async def test_a_crashing_trainer_returns_to_idle(tmp_path: Path, fake_trainer: Command) -> None:
    run = _run(fake_trainer("--exit-after-ms", "10", "--exit-code", "3"), tmp_path)
    await run.start()
    await run.wait_idle()
    assert _state(run) is TrainingRunState.IDLE


async def test_processes_left_behind_by_a_finished_trainer_are_killed(
    tmp_path: Path,
    fake_trainer: Command,
    wait_for: Any,
    alive: Callable[[int], bool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = _run(fake_trainer("--grandchild", "--exit-after-ms", "50"), tmp_path)
    await run.start()
    await run.wait_idle()
    pids = _ready_pids(tmp_path)
    assert pids is not None
    assert not any(alive(pid) for pid in pids)
    assert "left processes" in caplog.text


async def test_runs_refuse_starts_once_shutdown_began(
    tmp_path: Path, sim_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    runs = TrainingRuns(
        [
            _slot(sim_trainer(), tmp_path / "a", gpu_index=1),
            _slot(sim_trainer("--ignore-sigterm"), tmp_path / "b", gpu_index=2),
        ],
        base_env=dict(os.environ),
        poll_s=0.02,
    )
    assert await runs.start_all() == []
    await wait_for(
        lambda: all(read_trainer_checkpoint(tmp_path / d) is not None for d in ("a", "b"))
    )
    pids = [pid for status in await runs.statuses() for pid in status.pids]
    assert len(pids) == 2
    assert await runs.shutdown(0.3) is True
    assert runs.refusing_starts
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(ShuttingDownError):
        await runs.start_all()
    assert [s.state for s in await runs.statuses()] == [TrainingRunState.IDLE] * 2


async def test_start_all_reports_each_spawn_failure_and_starts_the_rest(
    tmp_path: Path, sim_trainer: Command
) -> None:
    runs = TrainingRuns(
        [
            _slot(("/nonexistent/trainer",), tmp_path / "a", gpu_index=1),
            _slot(sim_trainer(), tmp_path / "b", gpu_index=2),
        ],
        base_env=dict(os.environ),
        poll_s=0.02,
    )
    failures = await runs.start_all()
    assert [f.gpu_index for f in failures] == [1]
    run = runs.by_gpu(2)
    assert run is not None
    assert _state(run) is TrainingRunState.RUNNING
    assert await runs.shutdown(5.0) is True


def test_the_trainer_environment_helper_drops_per_slot_variables() -> None:
    env = trainer_base_env({"A": "1", "HARU_GPU_INDEX": "0", "HARU_CHECKPOINT_DIR": "/x"}, None)
    assert env == {"A": "1"}
    assert sys.executable  # the interpreter the trainers run on


def test_a_short_token_does_not_strip_variables_that_contain_it() -> None:
    parent = {"PATH": "/usr/local/bin:/usr/bin:/bin", "SHELL": "/bin/sh", "ALIAS": "bin"}
    env = trainer_base_env({**parent, "HARU_SUPERVISOR_TOKEN": "bin"}, "bin")
    assert env == {"PATH": parent["PATH"], "SHELL": "/bin/sh"}


# A trainer that tries to read the supervisor's environment (where HARU_SUPERVISOR_TOKEN may
# sit) and records who it runs as and what it got.
_SNOOP = (
    'cd "$HARU_CHECKPOINT_DIR" && id -u > uid.tmp && mv uid.tmp uid; '
    'cat "/proc/$1/environ" > environ 2>/dev/null; echo $? > rc.tmp && mv rc.tmp rc; '
    "exec sleep 60"
)


def _snooping_slot(directory: Path, run_as: str | None) -> SupervisorTrainingSlot:
    return SupervisorTrainingSlot(
        gpu_index=1,
        command=("/bin/sh", "-c", _SNOOP, "snoop", str(os.getpid())),
        checkpoint_dir=str(directory),
        run_as=run_as,
    )


def _shared_directory() -> Path:
    # World-writable: the runAs user must write there, and pytest's base directory is 0700.
    directory = Path(tempfile.mkdtemp(prefix="haru-runas-"))
    directory.chmod(0o777)
    return directory


@pytest.mark.skipif(os.geteuid() != 0, reason="runAs needs a root supervisor (tests not root)")
async def test_a_trainer_run_as_another_user_cannot_read_the_supervisor_environment(
    wait_for: Any, alive: Callable[[int], bool]
) -> None:
    results = {}
    for run_as in (None, "nobody"):
        directory = _shared_directory()
        run = TrainingRun(
            _snooping_slot(directory, run_as), base_env={"PATH": "/usr/bin:/bin"}, poll_s=0.02
        )
        try:
            await run.start()
            await wait_for(lambda d=directory: (d / "rc").exists())
            pids = await run.pids()
            assert pids
            results[run_as] = (
                int((directory / "uid").read_text()),
                int((directory / "rc").read_text()),
                (directory / "environ").read_bytes(),
                {os.stat(f"/proc/{pid}").st_uid for pid in pids},
            )
        finally:
            await run.stop(0.0)
            await run.wait_idle()
            shutil.rmtree(directory)
        assert not any(alive(pid) for pid in pids)
    # The control: as the supervisor's own user, the trainer reads its environment (where
    # HARU_SUPERVISOR_TOKEN would be).
    uid, rc, environ, owners = results[None]
    assert (uid, rc, owners) == (0, 0, {0})
    assert b"PATH=" in environ
    # As nobody, with the supervisor as root: the kernel refuses, nothing leaks.
    nobody = pwd.getpwnam("nobody").pw_uid
    uid, rc, environ, owners = results["nobody"]
    assert (uid, owners) == (nobody, {nobody})
    assert rc != 0
    assert environ == b""


def test_run_as_a_missing_user_is_refused_when_the_run_is_built(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such user"):
        TrainingRun(_snooping_slot(tmp_path, "no-such-user-haru"), base_env={})


async def test_trainer_output_is_logged_line_by_line_with_its_slot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = (
        "import sys\n"
        "print('step 1 loss=0.5')\n"
        "print('a\\x1b[2Kbar')\n"
        "sys.stdout.write('x' * 20000 + '\\n')\n"
        "sys.stderr.write('warning: no newline at the end')\n"
    )
    run = _run((sys.executable, "-c", script), tmp_path)
    with caplog.at_level(logging.INFO):
        assert await run.start() is True
        await run.wait_idle()
    records = [r for r in caplog.records if r.name == "haru_supervisor.trainer"]
    lines = [(r.__dict__["slot"], r.__dict__["stream"], r.getMessage()) for r in records]
    assert (1, "stdout", "GPU 1 stdout: step 1 loss=0.5") in lines
    assert (1, "stdout", "GPU 1 stdout: a\x1b[2Kbar") in lines  # escaped by the formatter
    assert (1, "stderr", "GPU 1 stderr: warning: no newline at the end") in lines
    # A line longer than the limit comes in pieces, none of it lost.
    pieces = [m for s, n, m in lines if n == "stdout" and "xxx" in m]
    assert sum(m.count("x") for m in pieces) == 20000
    assert len(pieces) >= 2
    # Every line was read before the run reported its end.
    exit_line = next(
        i for i, r in enumerate(caplog.records) if "exited with status 0" in r.getMessage()
    )
    assert all(caplog.records.index(r) < exit_line for r in records)
