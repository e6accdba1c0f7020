"""The emulated trainer as a real process: checkpoints, resume, signals, process groups."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import pytest
from haru_sim import CHECKPOINT_FILE, read_trainer_checkpoint

Eventually = Callable[..., Awaitable[None]]
CONSOLE_SCRIPT = Path(sys.executable).parent / "haru-sim-trainer"
START_RE = re.compile(
    r"haru-sim-trainer started pid=(\d+) resumed_step=(\d+) gpu=(\S+) child_pid=(\S+)\n"
)


class Trainer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.resumed_step = -1
        self.gpu = ""
        self.child_pid: int | None = None

    async def started(self) -> Trainer:
        assert self.proc.stdout is not None
        async with asyncio.timeout(20):
            line = (await self.proc.stdout.readline()).decode()
        match = START_RE.fullmatch(line)
        assert match is not None, line
        assert int(match.group(1)) == self.proc.pid
        self.resumed_step = int(match.group(2))
        self.gpu = match.group(3)
        self.child_pid = None if match.group(4) == "none" else int(match.group(4))
        return self

    async def finish(self) -> tuple[int, str, str]:
        async with asyncio.timeout(20):
            out, err = await self.proc.communicate()
        assert self.proc.returncode is not None
        return self.proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Trainer]]]:
    spawned: list[Trainer] = []

    async def start(*args: str, env: Mapping[str, str] | None = None) -> Trainer:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
        if env is None:
            env = {"HARU_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "HARU_GPU_INDEX": "1"}
        environment.update(env)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "haru_sim.trainer",
            *args,
            env=environment,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        trainer = Trainer(proc)
        spawned.append(trainer)
        return trainer

    yield start
    for trainer in spawned:
        if trainer.proc.returncode is None:
            os.killpg(trainer.proc.pid, signal.SIGKILL)
        await trainer.proc.communicate()
        if trainer.child_pid is not None and alive(trainer.child_pid):
            os.kill(trainer.child_pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_missing_checkpoint_dir_exits_2(
    spawn: Callable[..., Awaitable[Trainer]],
) -> None:
    trainer = await spawn(env={"HARU_GPU_INDEX": "0"})
    code, out, err = await trainer.finish()
    assert code == 2
    assert "HARU_CHECKPOINT_DIR" in err
    assert out == ""


async def test_bad_gpu_index_exits_2(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path
) -> None:
    trainer = await spawn(env={"HARU_CHECKPOINT_DIR": str(tmp_path), "HARU_GPU_INDEX": "gpu0"})
    code, _, err = await trainer.finish()
    assert code == 2
    assert "HARU_GPU_INDEX" in err


async def test_checkpoints_and_resumes(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    first = await (
        await spawn("--step-ms", "1", "--checkpoint-every", "3", "--max-steps", "7")
    ).started()
    assert (first.resumed_step, first.gpu) == (0, "1")
    code, out, _ = await first.finish()
    assert code == 0
    assert [line for line in out.splitlines() if "checkpoint" in line] == [
        "haru-sim-trainer checkpoint step=3",
        "haru-sim-trainer checkpoint step=6",
    ]
    saved = read_trainer_checkpoint(ckpt)
    assert saved is not None
    assert (saved.step, saved.gpu_index) == (7, 1)
    assert saved.saved_at.tzinfo is not None
    assert sorted(p.name for p in ckpt.iterdir()) == [CHECKPOINT_FILE]  # no temp file left

    second = await (await spawn("--step-ms", "1", "--max-steps", "10")).started()
    assert second.resumed_step == 7
    code, out, _ = await second.finish()
    assert code == 0
    assert "finished step=10" in out
    saved = read_trainer_checkpoint(ckpt)
    assert saved is not None
    assert saved.step == 10


async def test_sigterm_flushes_a_checkpoint_and_exits_0(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path, eventually: Eventually
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    seeded = datetime(2026, 1, 1, tzinfo=UTC)
    (ckpt / CHECKPOINT_FILE).write_text(
        json.dumps({"step": 5, "gpuIndex": 1, "savedAt": seeded.isoformat()})
    )
    trainer = await (await spawn("--step-ms", "5", "--checkpoint-every", "100000")).started()
    assert trainer.resumed_step == 5
    os.killpg(trainer.proc.pid, signal.SIGTERM)
    code, out, _ = await trainer.finish()
    assert code == 0
    match = re.search(r"stopped signal=SIGTERM step=(\d+)", out)
    assert match is not None, out
    saved = read_trainer_checkpoint(ckpt)
    assert saved is not None
    assert saved.saved_at > seeded  # written by the flush, not left over
    assert saved.step == int(match.group(1)) >= 5


async def test_term_delay_emulates_a_slow_flush(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path
) -> None:
    trainer = await (
        await spawn("--step-ms", "5", "--checkpoint-every", "100000", "--term-delay-ms", "300")
    ).started()
    loop = asyncio.get_running_loop()
    os.killpg(trainer.proc.pid, signal.SIGTERM)
    signalled = loop.time()
    code, _, _ = await trainer.finish()
    assert code == 0
    assert loop.time() - signalled >= 0.3
    assert read_trainer_checkpoint(tmp_path / "ckpt") is not None


async def test_ignore_sigterm_needs_sigkill(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path
) -> None:
    trainer = await (
        await spawn("--step-ms", "5", "--checkpoint-every", "100000", "--ignore-sigterm")
    ).started()
    os.killpg(trainer.proc.pid, signal.SIGTERM)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await trainer.proc.wait()
    os.killpg(trainer.proc.pid, signal.SIGKILL)
    code, _, _ = await trainer.finish()
    assert code == -signal.SIGKILL
    assert read_trainer_checkpoint(tmp_path / "ckpt") is None


async def test_grandchild_dies_with_the_process_group(
    spawn: Callable[..., Awaitable[Trainer]], eventually: Eventually
) -> None:
    trainer = await (await spawn("--spawn-child", "--ignore-sigterm")).started()
    child = trainer.child_pid
    assert child is not None
    assert alive(child)
    assert os.getpgid(child) == trainer.proc.pid  # same group as the trainer it leads
    os.killpg(trainer.proc.pid, signal.SIGKILL)
    code, _, _ = await trainer.finish()
    assert code == -signal.SIGKILL
    await eventually(lambda: not alive(child))


async def test_sigterm_to_the_group_stops_trainer_and_grandchild(
    spawn: Callable[..., Awaitable[Trainer]], eventually: Eventually
) -> None:
    trainer = await (await spawn("--spawn-child")).started()
    child = trainer.child_pid
    assert child is not None
    os.killpg(trainer.proc.pid, signal.SIGTERM)
    code, _, _ = await trainer.finish()
    assert code == 0
    await eventually(lambda: not alive(child))


async def test_fail_after_steps_exits_1_without_flushing(
    spawn: Callable[..., Awaitable[Trainer]], tmp_path: Path
) -> None:
    trainer = await (
        await spawn("--step-ms", "1", "--checkpoint-every", "4", "--fail-after-steps", "6")
    ).started()
    code, _, err = await trainer.finish()
    assert code == 1
    assert "simulated crash at step=6" in err
    saved = read_trainer_checkpoint(tmp_path / "ckpt")
    assert saved is not None
    assert saved.step == 4  # the last periodic checkpoint; a crash flushes nothing


async def test_console_script_runs(tmp_path: Path) -> None:
    env = {**os.environ, "HARU_CHECKPOINT_DIR": str(tmp_path)}
    env.pop("HARU_GPU_INDEX", None)
    proc = await asyncio.create_subprocess_exec(
        str(CONSOLE_SCRIPT),
        "--step-ms",
        "0",
        "--max-steps",
        "3",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert "gpu=unset" in out.decode()
    saved = read_trainer_checkpoint(tmp_path)
    assert saved is not None
    assert (saved.step, saved.gpu_index) == (3, None)


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '{"step": -1}',
        '{"step": 1}',
        '{"step": true, "savedAt": "2026-01-01T00:00:00+00:00"}',
    ],
)
def test_unreadable_checkpoints_read_as_none(tmp_path: Path, content: str) -> None:
    (tmp_path / CHECKPOINT_FILE).write_text(content)
    assert read_trainer_checkpoint(tmp_path) is None
    assert read_trainer_checkpoint(tmp_path / "missing") is None


async def test_sigterm_always_stops_a_trainer_whatever_its_wait_was_doing(
    spawn: Callable[..., Awaitable[Trainer]],
) -> None:
    # A 1 ms step puts the trainer inside or at the edge of a wait at nearly every instant, so
    # a SIGTERM lands wherever it lands. A handler that takes a lock the interrupted code may
    # hold (threading.Event.set) can leave a trainer deaf to SIGTERM: seen once in a promotion
    # benchmark and once in eight stop cycles of a local fleet, where only SIGKILL ended it
    # after the whole grace. The race is rare, so this loop guards the behaviour; it does not
    # reproduce the deadlock on demand.
    deaf = 0
    for _ in range(24):
        trainer = await (await spawn("--step-ms", "1", "--checkpoint-every", "100000")).started()
        await asyncio.sleep(0.005 + 0.001 * (_ % 5))
        os.killpg(trainer.proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(5):
                await trainer.proc.wait()
        except TimeoutError:
            deaf += 1
            os.killpg(trainer.proc.pid, signal.SIGKILL)
            await trainer.proc.wait()
        else:
            assert trainer.proc.returncode == 0
    assert deaf == 0
