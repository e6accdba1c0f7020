"""The server crashes in the middle of a promotion; a new server process finishes it.

The emulated vLLM servers wake slowly, so the promotion is certainly inside ``wake_vllm`` when
the server is SIGKILLed. A new server on the same database resumes the operation from that
step: the steps before it are not run again, and routing moves exactly once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from haru_demo import DemoTimings, DemoTopology, active_slug, fetch_events, is_standby_posture
from haru_protocol import OperationKind, OperationState, OperationStep

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow

PROMOTE_PLAN = [
    "stop_training",
    "verify_gpu",
    "wake_vllm",
    "probe",
    "switch_active",
    "demote_old_sleep",
    "demote_old_train",
]


async def test_server_restarted_mid_promotion_resumes_from_its_step(
    launch: Launch, eventually: Eventually, e2e_timings: Callable[..., DemoTimings]
) -> None:
    base = e2e_timings()
    timings = e2e_timings(
        wake_latency_ms=3_000,
        policy=base.policy.model_copy(update={"wake_timeout_ms": 60_000}),
    )
    topology = await launch(timings=timings)
    before = await topology.fleet()
    assert active_slug(before) == "alpha"

    accepted = await topology.request(OperationKind.PROMOTE, "beta")
    assert accepted is not None

    async def at_wake() -> bool:
        async with topology.control() as client:
            operation = await client.operation(topology.fleet_slug, accepted.id)
        assert operation.state in (OperationState.PENDING, OperationState.RUNNING)
        return operation.current_step is OperationStep.WAKE_VLLM

    await eventually(at_wake, what="the promotion to reach wake_vllm")
    await topology.stop_server(kill=True)
    crashed_at = datetime.now(UTC)
    await topology.start_server()

    final = await topology.wait_for_operation(accepted.id, timeout_s=60)

    assert final.state is OperationState.SUCCEEDED, final.error
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug)
    done = [e for e in events if e.operation_id == accepted.id and e.type == "operation.step.done"]
    assert [e.payload["step"] for e in done] == PROMOTE_PLAN
    by_step = {e.payload["step"]: e.created_at for e in done}
    assert by_step["verify_gpu"] < crashed_at < by_step["wake_vllm"]
    claims = [e for e in events if e.operation_id == accepted.id and e.type == "operation.started"]
    assert len(claims) == 1
    switches = [e for e in events if e.type == "routing.switched"]
    assert len(switches) == 1
    after = await topology.wait_for_fleet(
        lambda f: is_standby_posture(f, "alpha"), what="alpha in standby posture", timeout_s=30
    )
    assert active_slug(after) == "beta"
    assert after.route_revision == before.route_revision + 1
