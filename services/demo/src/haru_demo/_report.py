"""The scenario's results and the report printed at its end.

:class:`ApplyResult` and :class:`SwitchoverResult` hold what each step measured;
:class:`ScenarioReport` holds them all and renders the report, with the standby duty cycles
read from the server's ``/metrics`` (:func:`read_duty_cycles`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import aiohttp
from haru_protocol import (
    Operation,
    OperationState,
    bearer_header,
)
from prometheus_client.parser import text_string_to_metric_families

from haru_demo._traffic import RequestRecord, TrafficSummary


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
