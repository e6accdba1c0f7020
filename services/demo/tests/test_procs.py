"""Child processes of the demo: sessions, readiness lines, group kills and last-resort cleanup."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from haru_demo._procs import (
    DemoError,
    find_stray_trainers,
    kill_stray_trainers,
    log_tail,
    spawn,
)

needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

# A parent that starts a grandchild in its own process group, then announces itself.
PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild {child.pid}", flush=True)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie waiting for a reaper is dead for our purposes.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def gone(pid: int) -> bool:
    for _ in range(200):
        if not alive(pid):
            return True
        await asyncio.sleep(0.01)
    return False


@needs_proc
@pytest.mark.parametrize("ignore_term", [False, True])
async def test_stop_ends_the_whole_group(tmp_path: Path, ignore_term: bool) -> None:
    argv = [sys.executable, "-c", PARENT, *(["--ignore-term"] if ignore_term else [])]
    child = await spawn("parent", argv, env=os.environ, cwd=tmp_path, log_path=tmp_path / "p.log")
    assert os.getpgid(child.pid) == child.pid
    assert os.getsid(child.pid) == child.pid
    await child.wait_for_line(re.compile(r"^ready$", re.MULTILINE), timeout_s=30)
    match = await child.wait_for_line(re.compile(r"grandchild (\d+)"), timeout_s=1)
    grandchild = int(match.group(1))
    assert alive(grandchild)
    status = await child.stop(grace_s=0.3)
    assert status == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
    assert not child.running
    assert await gone(grandchild)


async def test_a_child_that_exits_before_ready_is_reported_with_its_log(tmp_path: Path) -> None:
    child = await spawn(
        "broken",
        [sys.executable, "-c", "import sys; print('bad flag --x', file=sys.stderr); sys.exit(2)"],
        env=os.environ,
        cwd=tmp_path,
        log_path=tmp_path / "broken.log",
    )
    with pytest.raises(DemoError, match=r"(?s)broken exited with status 2.*bad flag --x"):
        await child.wait_for_line(re.compile("ready"), timeout_s=30)


async def test_a_child_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    child = await spawn(
        "slow",
        [sys.executable, "-c", "import time; print('booting', flush=True); time.sleep(60)"],
        env=os.environ,
        cwd=tmp_path,
        log_path=tmp_path / "slow.log",
    )
    try:
        with pytest.raises(DemoError, match=r"(?s)slow did not get ready within 0s.*booting"):
            await child.wait_for_line(re.compile("ready"), timeout_s=0.3)
    finally:
        assert await child.kill() == -signal.SIGKILL


async def test_a_restarted_child_is_judged_on_its_own_lines(tmp_path: Path) -> None:
    log = tmp_path / "same.log"
    first = await spawn(
        "first",
        [sys.executable, "-c", "print('ready 1')"],
        env=os.environ,
        cwd=tmp_path,
        log_path=log,
    )
    await first.wait_for_line(re.compile(r"ready \d"), timeout_s=30)
    await first.stop(grace_s=1)
    second = await spawn(
        "second",
        [sys.executable, "-c", "import sys; sys.exit(3)"],
        env=os.environ,
        cwd=tmp_path,
        log_path=log,
    )
    with pytest.raises(DemoError, match="second exited with status 3"):
        await second.wait_for_line(re.compile(r"ready \d"), timeout_s=30)
    assert "ready 1" in log_tail(log)


async def test_spawn_failure_is_a_demo_error(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="cannot start ghost"):
        await spawn(
            "ghost",
            [str(tmp_path / "no-such-binary")],
            env=os.environ,
            cwd=tmp_path,
            log_path=tmp_path / "ghost.log",
        )


@needs_proc
async def test_stray_trainers_inside_the_workdir_are_killed_and_no_others(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    inside = await asyncio.create_subprocess_exec(
        *sleeper,
        env={**os.environ, "HARU_CHECKPOINT_DIR": str(root / "alpha-gpu0")},
        start_new_session=True,
    )
    outside = await asyncio.create_subprocess_exec(
        *sleeper,
        env={**os.environ, "HARU_CHECKPOINT_DIR": str(tmp_path / "checkpoints-other")},
        start_new_session=True,
    )
    try:
        for _ in range(200):
            if inside.pid in find_stray_trainers(root):
                break
            await asyncio.sleep(0.01)
        assert find_stray_trainers(root) == [inside.pid]
        assert kill_stray_trainers(root) == [inside.pid]
        assert await inside.wait() == -signal.SIGKILL
        assert outside.returncode is None
        assert find_stray_trainers(root) == []
    finally:
        for process in (inside, outside):
            if process.returncode is None:
                process.kill()
                await process.wait()


@needs_proc
def test_children_die_with_a_demo_process_that_exits_without_cleaning_up(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys
        from pathlib import Path
        from haru_demo._procs import spawn

        async def main():
            child = await spawn(
                "orphan", [sys.executable, "-c", "import time; time.sleep(600)"],
                env=os.environ, cwd=Path({str(tmp_path)!r}),
                log_path=Path({str(tmp_path)!r}) / "orphan.log",
            )
            print(child.pid, flush=True)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    orphan = int(done.stdout.strip())
    assert not alive(orphan)
