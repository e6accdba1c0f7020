"""A lost host is failed over on strong evidence, not after the staleness or the grace.

Real processes: ``haru serve`` (reconcile loop), two supervisors, emulated vLLM servers and
trainers. The active's host is lost: its supervisor, its vLLM servers and its trainers are
SIGKILLed, so every connection to it is refused, while the standby's supervisor answers. The
policy's ``heartbeatStaleMs`` and ``degradedGraceMs`` are ten minutes, so a failover within
the test's bound can only come from the evidence; the events say which.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from haru_demo import DemoTimings, DemoTopology, active_slug

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow

TEN_MINUTES_MS = 600_000


def processes_in(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}{os.sep}"):
            found.append(int(entry.name))
    return found


async def test_a_lost_host_fails_over_on_strong_evidence(
    launch: Launch, eventually: Eventually, e2e_timings: Callable[..., DemoTimings]
) -> None:
    base = e2e_timings()
    policy = base.policy.model_copy(
        update={"heartbeat_stale_ms": TEN_MINUTES_MS, "degraded_grace_ms": TEN_MINUTES_MS}
    )
    topology = await launch(timings=e2e_timings(policy=policy))
    fleet = await topology.fleet()
    assert active_slug(fleet) == "alpha"
    alpha = next(d for d in fleet.domains if d.slug == "alpha")

    supervisor = topology.domains["alpha"].supervisor
    assert supervisor is not None
    await supervisor.kill()
    await topology.kill_vllm("alpha")
    for pid in processes_in(topology.workdir / "alpha"):  # its trainers go with the host
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def moved() -> bool:
        return active_slug(await topology.fleet()) == "beta"

    await eventually(moved, what="a failover to beta", timeout_s=90)
    async with topology.control() as control:
        events = (await control.events(topology.fleet_slug, limit=1000)).events
    on_alpha = [e for e in events if e.domain_id == alpha.id]
    suspected = [e for e in on_alpha if e.type == "domain.dead_suspected"]
    escalated = [e for e in on_alpha if e.type == "domain.degraded.escalated"]
    assert suspected
    assert suspected[0].payload["evidence"] == "host_unreachable"
    assert len(escalated) == 1
    assert escalated[0].payload["evidence"] == "host_unreachable"
    assert escalated[0].id > suspected[0].id
    [auto] = [e for e in events if e.type == "operation.auto_failover"]
    assert auto.payload["reason"] == "active_failed"
