"""The demo's scenario: apply, planned switchover, unplanned failure and recovery.

Scenario, under steady SDK traffic through the proxy:

0. **apply**: bind a model the standby's vLLM already serves (started with it, not yet bound)
   with ``POST /v1/fleets/{ref}/apply``: a dry run whose plan is printed, then the apply against
   the plan's revisions; after the switchover below, requests for that model go through the
   proxy with the client key and must all succeed;
1. **planned switchover**: promote the standby; report each step's time (from the audit
   events), the time to the routing flip, and every request that failed while it ran (target:
   none), then check the old active went back to standby posture;
2. **unplanned failure**: SIGKILL every vLLM server of the active domain and let autoFailover
   act; report the time to detection (the ``operation.auto_failover`` event), each step, the
   routing flip, the first good answer from the new active, and the failed requests (counted
   honestly: traffic keeps flowing into a dead domain until routing moves);
3. **recovery**: restart the killed servers asleep and return that domain to standby posture.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Final

from haru_protocol import (
    Event,
    EventPayload,
    FleetLayout,
    FleetSnapshot,
    OperationAutoFailover,
    OperationKind,
    OperationState,
    Policy,
    RoutingSwitched,
    render_plan,
)
from haru_server.control_client import ControlApiError, ControlClient

from haru_demo._options import (
    UnboundModel,
)
from haru_demo._posture import active_slug, is_standby_posture
from haru_demo._procs import DemoError
from haru_demo._report import ApplyResult, ScenarioReport, SwitchoverResult, read_duty_cycles
from haru_demo._topology import DemoTopology
from haru_demo._traffic import ChatTraffic, TrafficSummary
from haru_demo._view import step_durations

WARMUP_S: Final = 2.0
"""Steady traffic before the first switchover."""
SETTLE_S: Final = 1.0
"""Traffic kept flowing after an operation ends before its requests are judged."""
BETWEEN_S: Final = 1.5
"""Steady traffic between the two switchovers."""
_FIRST_GOOD_WAIT_S: Final = 10.0
APPLY_MODEL: Final = "example-chat-mini"
"""The model the scenario's apply binds on the standby (its vLLM serves it from the start)."""
APPLY_REQUESTS: Final = 8
"""Requests for :data:`APPLY_MODEL` sent once the standby it was bound on is active."""


def apply_target(layout: FleetLayout) -> UnboundModel:
    """The model the apply binds: :data:`APPLY_MODEL` on the standby's first inference GPU."""
    active = layout.active_domain_slug or layout.domains[0].slug
    standby = next(d for d in layout.domains if d.slug != active)
    return UnboundModel(
        domain=standby.slug, gpu_index=standby.inference_slots[0].gpu_index, name=APPLY_MODEL
    )


def promote_budget_s(policy: Policy) -> float:
    """Sum of the budgets of every promote step up to and including ``switch_active``."""
    return (
        policy.stop_training_timeout_ms
        + policy.verify_gpu_timeout_ms
        + policy.wake_timeout_ms
        + policy.probe_timeout_ms
        + policy.switch_active_timeout_ms
    ) / 1000


def operation_budget_s(policy: Policy) -> float:
    """Every promote step's budget together (best-effort steps included)."""
    return (
        promote_budget_s(policy)
        + policy.sleep_timeout_ms / 1000
        + policy.start_training_timeout_ms / 1000
    )


async def fetch_events(client: ControlClient, fleet: str, *, after: int = 0) -> list[Event]:
    """Every event of the fleet after ``after``, oldest first."""
    events: list[Event] = []
    cursor = after
    while True:
        page = await client.events(fleet, after=cursor, limit=500)
        events.extend(page.events)
        if page.events:
            cursor = page.events[-1].id
        if page.next_after is None:
            return events


def _event_time(
    events: Sequence[Event], payload: type[EventPayload], *, operation_id: object = None
) -> float | None:
    for event in events:
        if isinstance(event.data, payload) and (
            operation_id is None or event.operation_id == operation_id
        ):
            return event.created_at.timestamp()
    return None


async def _last_event_id(topology: DemoTopology) -> int:
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug)
    return events[-1].id if events else 0


def _other_domain(fleet: FleetSnapshot, slug: str) -> str:
    return next(d.slug for d in fleet.domains if d.slug != slug)


async def apply_standby_model(
    topology: DemoTopology, added: UnboundModel, *, phase: Callable[[str], None]
) -> ApplyResult:
    """Bind ``added`` on its standby through ``POST /v1/fleets/{ref}/apply``.

    A dry run first (its plan is shown), then the apply carrying the plan's revisions: refused
    if the fleet moved in between. No operation drives the standby now, so the change is one
    the apply rules allow.
    """
    result = ApplyResult(model=added.name, domain=added.domain)
    layout = topology.layout_binding(added).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    phase(f"apply: planning {added.name} on {added.domain} (dry run)")
    try:
        async with topology.control() as client:
            planned = await client.apply(topology.fleet_slug, layout, dry_run=True)
            result.plan = render_plan(planned.plan)
            phase("apply: the plan\n" + result.plan)
            if planned.plan.refused:
                result.error = "the plan has refused changes"
                return result
            revisions = [r.model_dump(mode="json", by_alias=True) for r in planned.plan.revisions]
            applied = await client.apply(
                topology.fleet_slug, layout, dry_run=False, revisions=revisions
            )
    except ControlApiError as exc:
        result.error = str(exc)
        return result
    result.applied = applied.applied
    phase(
        f"apply: {added.name} bound on {added.domain}" if applied.applied else "apply: NOT applied"
    )
    return result


async def new_model_traffic(traffic: ChatTraffic, result: ApplyResult) -> None:
    """Send :data:`APPLY_REQUESTS` requests for the applied model and record them in ``result``.

    They use the traffic's client (and key) but are not among its records: the switchover
    windows count the steady traffic only.
    """
    records = [
        await traffic.send(traffic.clients, result.model, stream=number % 2 == 1, number=number)
        for number in range(APPLY_REQUESTS)
    ]
    result.requests = TrafficSummary.of(records)
    result.failures = [r for r in records if not r.ok]


async def planned_switchover(
    topology: DemoTopology, traffic: ChatTraffic, *, phase: Callable[[str], None]
) -> SwitchoverResult:
    """Promote the standby under traffic and measure it."""
    fleet = await topology.fleet()
    source = active_slug(fleet) or topology.initial_active()
    target = _other_domain(fleet, source)
    result = SwitchoverResult(
        kind="planned", source=source, target=target, budget_s=promote_budget_s(fleet.policy)
    )
    phase(f"planned switchover: promoting {target}")
    cursor = await _last_event_id(topology)
    requested = time.time()
    try:
        accepted = await topology.request(OperationKind.PROMOTE, target)
        if accepted is None:
            result.error = f"{target} was already active"
            return result
        result.operation = await topology.wait_for_operation(
            accepted.id, timeout_s=operation_budget_s(fleet.policy) + 5
        )
    except (DemoError, ControlApiError) as exc:
        result.error = str(exc)
        return result
    await asyncio.sleep(SETTLE_S)
    ended = time.time()
    operation = result.operation
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=cursor)
    result.steps = step_durations(events, operation.id)
    switched = _event_time(events, RoutingSwitched, operation_id=operation.id)
    result.routing_s = None if switched is None else switched - requested
    window = traffic.window(since=requested, until=ended)
    result.requests = TrafficSummary.of(window)
    result.failures = [r for r in window if not r.ok]
    if operation.state is not OperationState.SUCCEEDED:
        result.error = f"promote ended {operation.state.value}: {operation.error}"
    phase(f"planned switchover done: waiting for {source} to reach standby posture")
    try:
        await topology.wait_for_fleet(
            lambda f: is_standby_posture(f, source),
            what=f"{source} to reach standby posture",
            timeout_s=operation_budget_s(fleet.policy),
        )
        result.old_active_standby = True
    except DemoError:
        result.old_active_standby = False
    return result


async def unplanned_failover(
    topology: DemoTopology, traffic: ChatTraffic, *, phase: Callable[[str], None]
) -> SwitchoverResult:
    """SIGKILL the active domain's vLLM servers and measure the automatic failover."""
    fleet = await topology.fleet()
    source = active_slug(fleet) or topology.initial_active()
    target = _other_domain(fleet, source)
    policy = fleet.policy
    detection_budget_s = (policy.degraded_grace_ms + policy.heartbeat_stale_ms) / 1000
    result = SwitchoverResult(
        kind="unplanned",
        source=source,
        target=target,
        budget_s=detection_budget_s + promote_budget_s(policy),
    )
    cursor = await _last_event_id(topology)
    phase(f"unplanned failure: SIGKILL every vLLM server of {source}")
    killed = (await topology.kill_vllm(source)).timestamp()
    phase(f"unplanned failure: waiting for autoFailover to {target}")
    try:
        await topology.wait_for_fleet(
            lambda f: active_slug(f) == target,
            what=f"routing to move to {target}",
            timeout_s=result.budget_s,
        )
    except DemoError as exc:
        result.error = str(exc)
    deadline = time.monotonic() + _FIRST_GOOD_WAIT_S
    first = traffic.first_good_after(killed)
    while first is None and result.error is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        first = traffic.first_good_after(killed)
    result.first_good_s = None if first is None else first.ended_at - killed
    await asyncio.sleep(SETTLE_S)
    ended = time.time()
    window = traffic.window(since=killed, until=ended)
    result.requests = TrafficSummary.of(window)
    result.failures = [r for r in window if not r.ok]
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=cursor)
    auto = next((e for e in events if isinstance(e.data, OperationAutoFailover)), None)
    if auto is None:
        result.error = result.error or "no automatic failover was started"
        return result
    result.detection_s = auto.created_at.timestamp() - killed
    operation_id = auto.operation_id
    switched = _event_time(events, RoutingSwitched, operation_id=operation_id)
    result.routing_s = None if switched is None else switched - killed
    if operation_id is not None:
        async with topology.control() as client:
            result.operation = await client.operation(topology.fleet_slug, operation_id)
    return result


async def finish_failover(
    topology: DemoTopology, result: SwitchoverResult, *, phase: Callable[[str], None]
) -> None:
    """Wait for the failover's best-effort tail to end and record its steps."""
    operation = result.operation
    if operation is None:
        return
    fleet = await topology.fleet()
    phase("unplanned failure: waiting for the promote's best-effort steps")
    try:
        operation = await topology.wait_for_operation(
            operation.id, timeout_s=operation_budget_s(fleet.policy) + 5
        )
    except DemoError as exc:
        result.error = result.error or str(exc)
        return
    result.operation = operation
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug)
    result.steps = step_durations(events, operation.id)
    if operation.state is not OperationState.SUCCEEDED:
        result.error = result.error or f"promote ended {operation.state.value}"


async def recover(
    topology: DemoTopology,
    failover: SwitchoverResult,
    *,
    phase: Callable[[str], None],
) -> bool:
    """Restart the killed domain's vLLM servers asleep and return it to standby posture.

    They come back while the failover's best-effort tail may still be trying to put them to
    sleep: then that tail finishes the job (sleep, start training); otherwise a demote does.
    """
    slug = failover.source
    phase(f"recovery: restarting {slug}'s vLLM servers (asleep)")
    await topology.restart_vllm(slug, asleep=True)
    await finish_failover(topology, failover, phase=phase)
    fleet = await topology.fleet()
    budget = operation_budget_s(fleet.policy) + 10
    try:
        await topology.wait_for_fleet(
            lambda f: _domain_state(f, slug) in ("ready", "degraded"),
            what=f"{slug} to answer heartbeats again",
            timeout_s=budget,
        )
        phase(f"recovery: {slug} back to standby posture")
        await _ensure_posture(topology, slug, timeout_s=budget)
    except (DemoError, ControlApiError):
        return False
    return True


def _domain_state(fleet: FleetSnapshot, slug: str) -> str | None:
    return next((d.state.value for d in fleet.domains if d.slug == slug), None)


async def _ensure_posture(topology: DemoTopology, slug: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = await topology.fleet()
        if is_standby_posture(fleet, slug):
            return
        try:
            await topology.ensure_standby_posture()
        except ControlApiError as exc:
            # Another operation (the failover's best-effort tail) may still be in flight.
            if exc.code != "operation_conflict":
                raise
        if time.monotonic() >= deadline:
            raise DemoError(f"{slug} did not reach standby posture within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)


async def run_scenario(
    topology: DemoTopology, traffic: ChatTraffic, *, phase: Callable[[str], None]
) -> ScenarioReport:
    """Apply, planned switchover, unplanned failure with autoFailover, and recovery.

    The apply binds the topology's first unbound model (none: no apply step).
    """
    phase(f"steady traffic on {topology.initial_active()}")
    await asyncio.sleep(WARMUP_S)
    unbound = topology.options.unbound_models
    applied = await apply_standby_model(topology, unbound[0], phase=phase) if unbound else None
    planned = await planned_switchover(topology, traffic, phase=phase)
    report = ScenarioReport(planned=planned, apply=applied)
    if not (planned.succeeded and planned.switched):
        return report
    if applied is not None and applied.applied:
        phase(f"steady traffic on {planned.target}, and {applied.model} requests")
        await asyncio.gather(asyncio.sleep(BETWEEN_S), new_model_traffic(traffic, applied))
    else:
        phase(f"steady traffic on {planned.target}")
        await asyncio.sleep(BETWEEN_S)
    report.unplanned = await unplanned_failover(topology, traffic, phase=phase)
    report.recovered = await recover(topology, report.unplanned, phase=phase)
    report.duty_cycles = await read_duty_cycles(
        topology.server_url, fleet=topology.fleet_slug, token=topology.api_token()
    )
    return report


# ---- the command's main loop -----------------------------------------------------------------
