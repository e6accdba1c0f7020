"""``haru demo --scenario-only`` as a user runs it: a subprocess that must exit 0 and leave
nothing running behind it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from haru_demo import find_stray_trainers

pytestmark = pytest.mark.slow

_WORKDIR = re.compile(r"haru demo: workdir (\S+)")


def haru_command() -> list[str]:
    """``haru`` from this virtualenv (what ``uv run haru`` runs once the env is synced)."""
    script = Path(sys.executable).with_name("haru")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "haru_server"]


@pytest.mark.timeout(240)
def test_haru_demo_scenario_only_succeeds_and_cleans_up(
    processes_inside: Callable[[Path], list[int]],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    done = subprocess.run(
        [*haru_command(), "demo", "--scenario-only"],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
        check=False,
    )
    output = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, output
    assert "RESULT: success" in done.stdout, output
    # The apply: a dry run's plan adds a model the standby's vLLM serves but the layout did not
    # bind; the apply takes; once beta is active, that model's requests (client key) all answer.
    assert "apply: bind example-chat-mini on beta (standby), dry run first" in done.stdout, output
    assert re.search(
        r"^    \+ domain beta / inference gpu 0 / model example-chat-mini: "
        r"servingUrl http://127\.0\.0\.1:\d+$",
        done.stdout,
        re.MULTILINE,
    ), output
    assert "  applied: yes\n" in done.stdout, output
    applied = re.search(r"requests for it: +(\d+) sent, (\d+) ok, (\d+) failed", done.stdout)
    assert applied is not None, output
    sent, ok, failed = (int(n) for n in applied.groups())
    assert sent > 0, output
    assert (ok, failed) == (sent, 0), output
    assert "planned switchover: alpha -> beta (promote succeeded)" in done.stdout, output
    # Both the planned switchover and the unplanned failure (on the default policy) fail no
    # request; a stream the kill cut after its response had started is reported apart.
    during = re.findall(r"requests during it: +\d+ sent, \d+ ok, (\d+) failed", done.stdout)
    assert during == ["0", "0"], output
    assert "unplanned failure: beta -> alpha (promote succeeded)" in done.stdout, output
    match = _WORKDIR.search(done.stderr)
    assert match is not None, output
    workdir = Path(match.group(1))
    assert not workdir.exists(), "the temporary workdir is removed without --keep"
    assert processes_inside(workdir) == []
    assert find_stray_trainers(workdir / "checkpoints") == []


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
async def test_a_signalled_demo_stops_every_process_it_started(
    tmp_path: Path,
    signum: signal.Signals,
    status: int,
    processes_inside: Callable[[Path], list[int]],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    stdout = tmp_path / "stdout.txt"
    with stdout.open("wb") as out:
        demo = await asyncio.create_subprocess_exec(
            *haru_command(),
            "demo",
            "--no-scenario",
            "--port",
            "0",
            stdout=out,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    assert demo.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(120):
            while not any("serving on" in line for line in lines):
                line = await demo.stderr.readline()
                assert line, "\n".join(lines)
                lines.append(line.decode())
        match = _WORKDIR.search("".join(lines))
        assert match is not None
        workdir = Path(match.group(1))
        assert processes_inside(workdir), "the fleet runs"
        demo.send_signal(signum)
        async with asyncio.timeout(60):
            rest = await demo.stderr.read()
            assert await demo.wait() == status, "".join(lines) + rest.decode()
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
    assert "curl -s http://127.0.0.1:" in stdout.read_text()
    assert processes_inside(workdir) == []
    assert find_stray_trainers(workdir / "checkpoints") == []
    assert not await asyncio.to_thread(workdir.exists)
