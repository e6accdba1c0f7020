"""Fixtures of the repository-level tests: whole local fleets as real processes.

``launch`` starts a :class:`haru_demo.DemoTopology` (the launcher ``haru demo`` uses)
in the test's temporary folder and stops every process at teardown; when the test failed, the
end of each process's log is printed. ``launcher`` is the same as an async context manager,
for fixtures that must stop the topology before their own teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from haru_demo import DemoTimings, DemoTopology, TopologyOptions, log_tail
from haru_protocol import PolicyPatch

E2E_POLICY = PolicyPatch(
    auto_failover=True,
    heartbeat_stale_ms=3_000,
    degraded_grace_ms=500,
    training_stop_grace_ms=1_000,
    failover_training_stop_grace_ms=1_000,
    stop_training_timeout_ms=5_000,
    verify_gpu_timeout_ms=5_000,
    wake_timeout_ms=10_000,
    probe_timeout_ms=5_000,
    switch_active_timeout_ms=5_000,
    sleep_timeout_ms=1_500,
    start_training_timeout_ms=5_000,
)

E2E_TIMINGS = DemoTimings(
    sleep_latency_ms=20,
    wake_latency_ms=100,
    first_token_latency_ms=2,
    token_latency_ms=1,
    trainer_step_ms=50,
    trainer_checkpoint_every=5,
    reconcile_interval_ms=300,
    supervisor_shutdown_grace_ms=1_000,
    stop_grace_s=5.0,
    ready_timeout_s=60.0,
    policy=E2E_POLICY,
)

Launch = Callable[..., Awaitable[DemoTopology]]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


def _report_logs(topologies: list[DemoTopology]) -> None:
    for topology in topologies:
        for log in sorted((topology.workdir / "logs").glob("*.log")):
            print(f"===== {log} =====\n{log_tail(log, 3000)}")


@contextlib.asynccontextmanager
async def launcher(base: Path, request: pytest.FixtureRequest) -> AsyncIterator[Launch]:
    started: list[DemoTopology] = []

    async def factory(*, timings: DemoTimings = E2E_TIMINGS, **options: Any) -> DemoTopology:
        topology = DemoTopology(
            TopologyOptions(workdir=base / f"fleet-{len(started)}", timings=timings, **options)
        )
        started.append(topology)
        await topology.start()
        return topology

    try:
        yield factory
    finally:
        for topology in started:
            await topology.close()
        if request.node.stash.get(_FAILED, True):
            _report_logs(started)


@pytest.fixture
async def launch(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Launch]:
    """``topology = await launch(timings=..., database_url=..., ...)``; stopped at teardown.

    When the test fails, the end of every process log is printed.
    """
    async with launcher(tmp_path, request) as factory:
        yield factory


@pytest.fixture
def launch_context(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Callable[[], contextlib.AbstractAsyncContextManager[Launch]]:
    """``async with launch_context() as launch:``, for fixtures that must stop their topology
    before their own teardown (e.g. before a database they requested is handed back)."""
    return lambda: launcher(tmp_path, request)


def _processes_inside(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}{os.sep}"):
            found.append(int(entry.name))
    return found


@pytest.fixture
def processes_inside() -> Callable[[Path], list[int]]:
    """``processes_inside(folder)``: pids of live processes working in ``folder`` (Linux).

    Every process a topology starts works inside its workdir (trainers inherit their
    supervisor's folder), so an empty answer after a stop means nothing was left behind.
    """
    if not Path("/proc").is_dir():
        pytest.skip("finds processes through /proc")
    return _processes_inside


def timings(**changes: Any) -> DemoTimings:
    """The e2e timings with some fields (or policy keys, as ``policy=...``) changed."""
    return replace(E2E_TIMINGS, **changes)


@pytest.fixture
def e2e_timings() -> Callable[..., DemoTimings]:
    """``e2e_timings(wake_latency_ms=...)``: the suite's timings with changes."""
    return timings


Eventually = Callable[..., Awaitable[Any]]


async def _eventually(
    probe: Callable[[], Any], *, what: str, timeout_s: float = 30.0, interval_s: float = 0.05
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


@pytest.fixture
def eventually() -> Eventually:
    """``value = await eventually(probe, what=..., timeout_s=...)``: poll until truthy.

    ``probe`` may be a plain function or return a coroutine; its first truthy value is returned.
    """
    return _eventually
