"""The topology launcher itself: it fails loudly and never leaves a process behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from haru_demo import DemoError, DemoTimings, DemoTopology, TopologyOptions, find_stray_trainers

pytestmark = pytest.mark.slow

ProcessesInside = Callable[[Path], list[int]]

TIMINGS = DemoTimings(ready_timeout_s=60.0, stop_grace_s=5.0)


async def test_an_engine_that_cannot_start_fails_the_start_with_its_log(
    tmp_path: Path, processes_inside: ProcessesInside
) -> None:
    topology = DemoTopology(
        TopologyOptions(workdir=tmp_path, timings=replace(TIMINGS, wake_latency_ms=-1))
    )
    with pytest.raises(DemoError, match=r"(?s)vllm-.* exited with status 2 .*wake"):
        async with topology:
            pytest.fail("the topology must not start")
    assert processes_inside(tmp_path) == []
    assert find_stray_trainers(tmp_path / "checkpoints") == []


async def test_a_start_cancelled_half_way_leaves_nothing_running(
    tmp_path: Path, processes_inside: ProcessesInside
) -> None:
    topology = DemoTopology(TopologyOptions(workdir=tmp_path, timings=TIMINGS))
    start = asyncio.create_task(topology.start())
    for _ in range(500):
        if len(processes_inside(tmp_path)) >= 3:
            break
        await asyncio.sleep(0.01)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await topology.close()
    assert processes_inside(tmp_path) == []


async def test_a_workdir_that_holds_a_database_is_refused(
    tmp_path: Path, processes_inside: ProcessesInside
) -> None:
    (tmp_path / "haru.db").write_bytes(b"")
    topology = DemoTopology(TopologyOptions(workdir=tmp_path, timings=TIMINGS))
    with pytest.raises(DemoError, match="already exists"):
        async with topology:
            pytest.fail("the topology must not start")
    assert processes_inside(tmp_path) == []
