"""The demo's scenario and the ``haru demo`` main loop.

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

:func:`run_demo` runs the topology, the live view, the scenario, and then serves until Ctrl-C
(or ``--duration``), stopping every process it started on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import aiohttp
from haru_protocol import (
    Event,
    EventPayload,
    FleetLayout,
    FleetSnapshot,
    Operation,
    OperationAutoFailover,
    OperationKind,
    OperationState,
    Policy,
    RoutingSwitched,
    bearer_header,
    load_example_layout,
    render_plan,
)
from haru_server.control_client import ControlApiError, ControlClient
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live

from haru_demo._procs import DemoError
from haru_demo._topology import (
    DEFAULT_DEMO_PORT,
    DemoTimings,
    DemoTopology,
    TopologyOptions,
    UnboundModel,
    active_slug,
    is_standby_posture,
    port_is_free,
)
from haru_demo._traffic import ChatTraffic, RequestRecord, TrafficSummary
from haru_demo._view import FleetWatcher, ViewState, render_view, step_durations

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


@dataclass(slots=True, kw_only=True)
class ApplyResult:
    """How the apply that binds a model on the standby went, and its model's traffic.

    Attributes:
        model: The model bound.
        domain: The standby it was bound on.
        plan: The dry run's plan as text.
        applied: The apply made the plan's changes.
        requests: The requests for :attr:`model` once its domain was active.
        failures: The ones that failed.
        error: What went wrong, when something did.
    """

    model: str
    domain: str
    plan: str = ""
    applied: bool = False
    requests: TrafficSummary = field(default_factory=lambda: TrafficSummary(0, 0, 0, 0))
    failures: list[RequestRecord] = field(default_factory=list)
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        """Applied, and every request for the new model answered."""
        requests = self.requests
        return self.applied and requests.total > 0 and requests.ok == requests.total

    def lines(self) -> list[str]:
        """The apply's part of the report."""
        out = [f"apply: bind {self.model} on {self.domain} (standby), dry run first"]
        out.extend(f"  {line}" for line in self.plan.splitlines())
        out.append(f"  applied: {'yes' if self.applied else 'NO'}")
        requests = self.requests
        out.append(
            _row(
                "requests for it",
                f"{requests.total} sent, {requests.ok} ok, {requests.failed} failed "
                f"(client key, once {self.domain} was active)",
            )
        )
        reasons: dict[str, int] = {}
        for record in self.failures:
            reason = record.error or "?"
            reasons[reason] = reasons.get(reason, 0) + 1
        out.extend(f"    {count} x {reason}" for reason, count in sorted(reasons.items()))
        if self.error:
            out.append(f"  problem: {self.error}")
        return out


@dataclass(slots=True, kw_only=True)
class SwitchoverResult:
    """How one switchover went.

    Attributes:
        kind: ``planned`` or ``unplanned``.
        source: Domain that was active before.
        target: Domain that should be active after.
        operation: The promote, as it ended (None when none was seen).
        steps: ``(step, seconds)`` from the operation's events.
        detection_s: Failure to ``operation.auto_failover`` (unplanned only).
        routing_s: Request (planned) or failure (unplanned) to the routing flip.
        first_good_s: Failure to the first good answer from the new active (unplanned only).
        requests: The demo's requests in flight during the switchover.
        failures: The ones that failed.
        budget_s: Deadline of the routing flip.
        old_active_standby: The old active reached standby posture afterwards (planned only).
        error: What went wrong, when something did.
    """

    kind: str
    source: str
    target: str
    operation: Operation | None = None
    steps: list[tuple[str, float]] = field(default_factory=list)
    detection_s: float | None = None
    routing_s: float | None = None
    first_good_s: float | None = None
    requests: TrafficSummary = field(default_factory=lambda: TrafficSummary(0, 0, 0, 0))
    failures: list[RequestRecord] = field(default_factory=list)
    budget_s: float = 0.0
    old_active_standby: bool | None = None
    error: str | None = None

    @property
    def switched(self) -> bool:
        """Routing moved to the target within the budget."""
        return self.routing_s is not None and self.routing_s <= self.budget_s

    @property
    def succeeded(self) -> bool:
        """The operation succeeded."""
        return self.operation is not None and self.operation.state is OperationState.SUCCEEDED


@dataclass(slots=True, kw_only=True)
class ScenarioReport:
    """The scenario's outcome."""

    planned: SwitchoverResult
    apply: ApplyResult | None = None
    """The apply before the planned switchover (None: the topology serves no unbound model)."""
    unplanned: SwitchoverResult | None = None
    recovered: bool | None = None
    duty_cycles: dict[str, float] | None = None
    """Standby duty cycle per domain (the server's ``haru_standby_duty_cycle_ratio``)."""

    @property
    def ok(self) -> bool:
        """Whether the scenario met its targets.

        Zero failed requests in the planned switchover and in the unplanned failure (a stream
        that the kill cut after its response had started is counted apart: no proxy can send
        it again), the old active back in standby posture, a failover within its budget, and the
        failed domain recovered; and when there was an apply, it was applied and every request
        for its model answered.
        """
        if self.apply is not None and not self.apply.succeeded:
            return False
        planned = self.planned
        if not (planned.succeeded and planned.switched and not planned.failures):
            return False
        if self.unplanned is not None and self.unplanned.requests.failed:
            return False
        if planned.old_active_standby is False:
            return False
        unplanned = self.unplanned
        if unplanned is None or not (unplanned.switched and unplanned.succeeded):
            return False
        return self.recovered is True

    def lines(self) -> list[str]:
        """The report as text lines."""
        out = [
            *(self.apply.lines() if self.apply is not None else ()),
            *_switchover_lines(self.planned),
        ]
        if self.unplanned is not None:
            out.extend(_switchover_lines(self.unplanned))
        if self.recovered is not None:
            out.append(
                "recovery: failed domain restarted, back in standby posture (vLLM asleep, "
                "training running)"
                if self.recovered
                else "recovery: the failed domain did NOT return to standby posture"
            )
        if self.duty_cycles is not None:
            out.append(_duty_cycle_line(self.duty_cycles))
        out.append("RESULT: " + ("success" if self.ok else "FAILED"))
        return out


def _duty_cycle_line(cycles: dict[str, float]) -> str:
    shares = ", ".join(f"{domain} {ratio:.0%}" for domain, ratio in sorted(cycles.items()))
    return "standby duty cycle (standby time with every training slot running): " + (
        shares or "not measured (no standby heartbeat interval yet)"
    )


DUTY_CYCLE_METRIC: Final = "haru_standby_duty_cycle_ratio"


def parse_duty_cycles(text: str, *, fleet: str) -> dict[str, float]:
    """The standby duty cycle of each domain of ``fleet`` from the server's ``/metrics`` text."""
    return {
        sample.labels["domain"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == DUTY_CYCLE_METRIC and sample.labels.get("fleet") == fleet
    }


async def read_duty_cycles(
    server_url: str, *, fleet: str, token: str | None = None
) -> dict[str, float] | None:
    """Scrape the server's ``/metrics`` for the duty cycles (None when it cannot be read).

    ``token`` is the server's admin token (``/metrics`` is behind it).
    """
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"{server_url}/metrics", headers=bearer_header(token)) as response,
        ):
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_duty_cycles(text, fleet=fleet)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _row(label: str, value: str) -> str:
    return f"  {label + ':':<26}{value}"


def _switchover_lines(result: SwitchoverResult) -> list[str]:
    title = "planned switchover" if result.kind == "planned" else "unplanned failure"
    state = result.operation.state.value if result.operation is not None else "not seen"
    lines = [f"{title}: {result.source} -> {result.target} (promote {state})"]
    if result.detection_s is not None or result.kind == "unplanned":
        lines.append(_row("time to detection", _ms(result.detection_s)))
    if result.steps:
        lines.append(
            _row("steps", ", ".join(f"{step} {_ms(seconds)}" for step, seconds in result.steps))
        )
    label = "request to routing flip" if result.kind == "planned" else "failure to routing flip"
    lines.append(_row(label, f"{_ms(result.routing_s)} (budget {result.budget_s:.0f} s)"))
    if result.kind == "unplanned":
        lines.append(_row("first good answer", f"{_ms(result.first_good_s)} after the kill"))
    requests = result.requests
    lines.append(
        _row(
            "requests during it",
            f"{requests.total} sent, {requests.ok} ok, {requests.failed} failed"
            + (
                f", {requests.cut} stream(s) cut after their response had started"
                if requests.cut
                else ""
            ),
        )
    )
    reasons: dict[str, int] = {}
    for record in result.failures:
        reason = record.error or "?"
        reasons[reason] = reasons.get(reason, 0) + 1
    lines.extend(f"    {count} x {reason}" for reason, count in sorted(reasons.items()))
    if requests.held:
        lines.append(
            _row(
                "held through it",
                f"{requests.held} answered after a hold, longest {requests.longest_hold_ms} ms",
            )
        )
    if result.old_active_standby is not None:
        lines.append(
            f"  old active back in standby posture: {'yes' if result.old_active_standby else 'NO'}"
        )
    if result.error:
        lines.append(f"  problem: {result.error}")
    return lines


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


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoRun:
    """What ``haru demo`` was asked to do."""

    workdir: Path
    port: int = DEFAULT_DEMO_PORT
    scenario: bool = True
    scenario_only: bool = False
    duration_s: float | None = None
    timings: DemoTimings = field(default_factory=DemoTimings)
    clients: int = 4


def snippets(server_url: str, fleet: str, model: str, *, key_file: Path, token_file: Path) -> str:
    """What to try against the running demo: the client key's and admin token's files."""
    return f"""\
Try it (HARU_DEFAULT_FLEET={fleet}, so no X-Haru-Fleet header is needed). Inference takes
the demo's client key, the control API its admin token (each in a file, mode 0600):

  export OPENAI_API_KEY="$(cat {key_file})" HARU_API_TOKEN_FILE={token_file}

  curl -s {server_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -H "Authorization: Bearer $OPENAI_API_KEY" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hello haru"}}]}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{server_url}/v1")  # the key from OPENAI_API_KEY
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "hello haru"}}])
  print(reply.choices[0].message.content)
  EOF

  uv run haru fleet show {fleet} --url {server_url}
  uv run haru keys list --url {server_url}
  uv run haru promote {fleet} alpha --wait --url {server_url}
  uv run haru events {fleet} --follow --url {server_url}
"""


def run_demo(run: DemoRun) -> int:
    """Run the demo; returns the exit status (SIGTERM and Ctrl-C stop it cleanly)."""
    try:
        return asyncio.run(_main(run))
    except KeyboardInterrupt:
        return 130


_SIGNAL_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}
"""Exit status after a stop by each signal (128 + the signal number, as shells report it)."""


async def _main(run: DemoRun) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    stopped_by: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        # SIGTERM and Ctrl-C take the same path: cancel the demo, whose cleanup stops every
        # process it started, then exit with the signal's status. (asyncio.run's own SIGINT
        # handling would re-raise KeyboardInterrupt around the cleanup instead.)
        if stopped_by:
            return
        stopped_by.append(signum)
        # A second Ctrl-C during the cleanup then interrupts at once (the atexit hook still
        # kills the process groups left behind).
        loop.remove_signal_handler(signal.SIGINT)
        if task is not None:
            task.cancel()

    handled: list[signal.Signals] = []
    for signum in _SIGNAL_STATUS:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, on_signal, signum)
            handled.append(signum)
    try:
        return await _demo(run)
    except asyncio.CancelledError:
        if stopped_by:
            return _SIGNAL_STATUS[stopped_by[0]]
        raise
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _demo(run: DemoRun) -> int:
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    port = run.port
    if port and not port_is_free(port):
        err.print(f"port {port} is taken: the server will listen on a free port instead")
        port = 0
    # The server has an admin token; the traffic uses a client key created through the API.
    topology = DemoTopology(
        TopologyOptions(
            workdir=run.workdir,
            server_port=port,
            timings=run.timings,
            api_token=secrets.token_urlsafe(32),
            # The standby's vLLM serves one model more than the layout binds: the apply binds it.
            unbound_models=(apply_target(load_example_layout()),),
        )
    )
    err.print(f"[bold]haru demo[/]: workdir {topology.workdir} (logs in {topology.workdir}/logs)")
    try:
        await topology.start(on_progress=lambda message: err.print(f"  {message}"))
        return await _run_with_view(run, topology, console, err)
    except DemoError as exc:
        err.print(f"[bold red]demo failed:[/] {exc}")
        return 1
    finally:
        err.print("stopping every process the demo started")
        await topology.close()


async def _run_with_view(
    run: DemoRun, topology: DemoTopology, console: Console, err: Console
) -> int:
    fleet = await topology.fleet()
    models = list(dict.fromkeys(m for d in topology.domains.values() for m in d.models))
    state = ViewState(server_url=topology.server_url)
    key = await topology.create_client_key("haru-demo-traffic")
    key_file = topology.secrets_dir / "client.key"
    descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(key + "\n")
    traffic = ChatTraffic(
        topology.server_url, fleet=fleet.slug, models=models, clients=run.clients, api_key=key
    )
    vllm_urls = {
        slug: [server.url for server in domain.vllm.values()]
        for slug, domain in topology.domains.items()
    }
    live: Live | None = None

    def say(text: str) -> None:
        # Above the live view when there is one (it scrolls), else plain lines.
        if live is not None:
            live.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def phase(text: str) -> None:
        state.phase = text
        stamp = f"[{datetime.now(UTC).astimezone():%H:%M:%S}] {text}"
        if live is not None:
            say(stamp)
        else:
            err.print(stamp, markup=False, highlight=False, soft_wrap=True)

    status = 0
    async with topology.control() as control, aiohttp.ClientSession() as session:
        watcher = FleetWatcher(
            state,
            fleet=fleet.slug,
            control=control,
            session=session,
            vllm_urls=vllm_urls,
            traffic=traffic,
        )
        await watcher.poll()
        if console.is_terminal:
            live = Live(render_view(state), console=console, auto_refresh=False)
        refresher: asyncio.Task[None] | None = None
        watcher.start()
        try:
            if live is not None:
                live.start()
                refresher = asyncio.create_task(_refresh(live, state), name="haru-demo-view")
            if run.scenario:
                traffic.start()
                try:
                    report = await run_scenario(topology, traffic, phase=phase)
                finally:
                    await traffic.stop()
                status = 0 if report.ok else 1
                say("\n".join(report.lines()))
            if run.scenario_only:
                phase("scenario finished")
                return status
            phase(f"serving on {topology.server_url} (Ctrl-C to stop)")
            say(
                snippets(
                    topology.server_url,
                    fleet.slug,
                    models[0],
                    key_file=key_file,
                    token_file=topology.api_token_file(),
                )
            )
            if run.duration_s is not None:
                await asyncio.sleep(run.duration_s)
            else:
                await asyncio.Event().wait()
            return status
        finally:
            if refresher is not None:
                refresher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresher
            await watcher.stop()
            if live is not None:
                live.update(render_view(state), refresh=True)
                live.stop()


async def _refresh(live: Live, state: ViewState) -> None:
    while True:
        live.update(render_view(state), refresh=True)
        await asyncio.sleep(0.25)
