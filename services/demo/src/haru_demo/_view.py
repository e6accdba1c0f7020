"""The demo's live view: what the server's API says, rendered with rich.

:class:`FleetWatcher` polls the control API (``GET /v1/fleets/{ref}``, ``.../events`` and the
operation the latest events name) and each emulated vLLM server's ``GET /_sim/state`` (requests
it served). :func:`render_view` turns a :class:`ViewState` into one rich renderable; it does no
I/O, so it is tested on recorded snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final
from uuid import UUID

import aiohttp
from haru_protocol import (
    DomainDegradedEscalated,
    DomainHeartbeatFailed,
    DomainNotReady,
    DomainSnapshot,
    DomainStateChanged,
    DomainSupervisorUnauthorized,
    Event,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    OperationAutoFailover,
    OperationFailed,
    OperationRequestedDemote,
    OperationRequestedPromote,
    OperationRestoreDemote,
    OperationStarted,
    OperationState,
    OperationStepDone,
    OperationStepTimeoutBestEffort,
    OperationSucceeded,
    RoutingSwitched,
    SlotSnapshot,
    SlotStateChanged,
    TrainingSlotState,
    UntypedEventPayload,
)
from haru_server.control_client import ControlApiError, ControlClient
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from haru_demo._traffic import ChatTraffic, TrafficSummary

EVENT_ROWS: Final = 6
_SIM_STATE_TIMEOUT_S: Final = 0.5
_CHAT_PATH: Final = "/v1/chat/completions"

_SLOT_STYLE: Final[Mapping[str, str]] = {
    InferenceSlotState.SERVING.value: "bold green",
    InferenceSlotState.SLEEPING.value: "blue",
    InferenceSlotState.WAKING.value: "yellow",
    InferenceSlotState.PROBING.value: "yellow",
    InferenceSlotState.STARTING.value: "yellow",
    InferenceSlotState.FAILED.value: "bold red",
    InferenceSlotState.STOPPED.value: "dim",
    TrainingSlotState.TRAINING.value: "magenta",
    TrainingSlotState.IDLE.value: "dim",
    TrainingSlotState.STOPPING.value: "yellow",
}
_DOMAIN_STYLE: Final[Mapping[str, str]] = {
    "ready": "green",
    "degraded": "yellow",
    "failed": "bold red",
    "provisioning": "yellow",
}


@dataclass(slots=True)
class ViewState:
    """Everything the live view shows.

    Attributes:
        server_url: Where the server listens.
        fleet: The latest snapshot (None before the first answer).
        events: The most recent events, oldest first.
        operation: The in-flight operation, or the last one seen.
        served: Chat completions each domain's vLLM servers answered (probes included).
        traffic: Counts of the demo's own requests.
        rate: Demo requests per second over the last few seconds.
        phase: What the scenario is doing.
        traffic_running: Whether the demo's traffic is flowing now.
        error: Why the last poll failed, if it did.
    """

    server_url: str
    fleet: FleetSnapshot | None = None
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=EVENT_ROWS))
    operation: Operation | None = None
    served: dict[str, int] = field(default_factory=dict)
    traffic: TrafficSummary | None = None
    rate: float = 0.0
    phase: str = ""
    traffic_running: bool = False
    error: str | None = None


def _slot_cell(slots: Iterable[SlotSnapshot]) -> Text:
    text = Text()
    for slot in slots:
        if text:
            text.append(" / ")
        label = "vllm" if slot.inference_spec is not None else "train"
        text.append(f"{label} ")
        text.append(slot.state.value, style=_SLOT_STYLE.get(slot.state.value, ""))
    return text or Text("-", style="dim")


def _ago(at: datetime | None, now: datetime) -> str:
    if at is None:
        return "never"
    return f"{max(0.0, (now - at).total_seconds()):.1f}s ago"


def _domains_table(fleet: FleetSnapshot, served: Mapping[str, int], now: datetime) -> Table:
    gpus = sorted({s.gpu_index for d in fleet.domains for s in d.slots})
    table = Table(expand=True, title=None)
    table.add_column("domain")
    table.add_column("role")
    table.add_column("state")
    table.add_column("heartbeat")
    for gpu in gpus:
        table.add_column(f"GPU {gpu}")
    table.add_column("served", justify="right")
    for domain in fleet.domains:
        active = domain.id == fleet.active_domain_id
        role = Text("ACTIVE", style="bold green") if active else Text("standby", style="blue")
        cells: list[RenderableType] = [
            Text(domain.slug, style="bold"),
            role,
            Text(domain.state.value, style=_DOMAIN_STYLE.get(domain.state.value, "")),
            _ago(domain.last_seen_at, now),
        ]
        cells.extend(_slot_cell(s for s in domain.slots if s.gpu_index == gpu) for gpu in gpus)
        cells.append(str(served.get(domain.slug, 0)))
        table.add_row(*cells)
    return table


def _domain_slug(fleet: FleetSnapshot | None, domain_id: UUID | None) -> str:
    if fleet is None or domain_id is None:
        return "-" if domain_id is None else str(domain_id)[:8]
    domain: DomainSnapshot | None = fleet.domain(domain_id)
    return domain.slug if domain is not None else str(domain_id)[:8]


def _operation_text(state: ViewState, now: datetime) -> Text:
    operation = state.operation
    if operation is None:
        return Text("no operation yet", style="dim")
    target = _domain_slug(state.fleet, operation.target_domain_id)
    text = Text()
    text.append(f"{operation.kind.value} ", style="bold")
    text.append(f"-> {target}  ")
    style = {
        OperationState.SUCCEEDED: "bold green",
        OperationState.FAILED: "bold red",
        OperationState.RUNNING: "yellow",
    }.get(operation.state, "")
    text.append(operation.state.value, style=style)
    in_flight = operation.state in (OperationState.PENDING, OperationState.RUNNING)
    if in_flight and operation.current_step is not None:
        text.append(f"  step {operation.current_step.value}", style="bold yellow")
        if operation.step_started_at is not None:
            seconds = max(0.0, (now - operation.step_started_at).total_seconds())
            text.append(f" ({seconds:.1f}s)")
    if operation.error is not None:
        step = operation.error.step.value if operation.error.step else "?"
        text.append(f"  {operation.error.code} at {step}: {operation.error.message}", style="red")
    timings = step_durations(state.events, operation.id)
    if timings:
        text.append("\n  ")
        text.append(
            "  ".join(f"{step} {seconds * 1000:.0f}ms" for step, seconds in timings), style="dim"
        )
    return text


def _events_table(state: ViewState) -> Table:
    table = Table(expand=True, show_header=True, box=None)
    table.add_column("time", style="dim", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("domain", no_wrap=True)
    table.add_column("detail", overflow="ellipsis", no_wrap=True)
    for event in state.events:
        table.add_row(
            event.created_at.astimezone().strftime("%H:%M:%S.%f")[:-3],
            event.type,
            _domain_slug(state.fleet, event.domain_id),
            event_detail(event),
        )
    return table


_DETAIL_KEYS = ("step", "from", "to", "kind", "reason", "code", "message", "routeRevision")


def event_detail(event: Event) -> str:
    """A short human summary of an event's payload (its typed model, by event type)."""
    facts: dict[str, object]
    match event.data:
        case UntypedEventPayload(data=dict() as raw):
            facts = {key: raw.get(key) for key in _DETAIL_KEYS}
        case UntypedEventPayload():
            facts = {}
        case OperationStepDone(step=step, route_revision=revision):
            facts = {"step": step.value, "routeRevision": revision}
        case OperationStepTimeoutBestEffort(step=step):
            facts = {"step": step.value}
        case OperationFailed(step=step, code=code, message=message):
            facts = {"step": step.value, "code": code.value, "message": message}
        case (
            OperationRequestedPromote(kind=kind)
            | OperationRequestedDemote(kind=kind)
            | OperationStarted(kind=kind)
            | OperationSucceeded(kind=kind)
        ):
            facts = {"kind": kind.value}
        case OperationAutoFailover(reason=reason) | OperationRestoreDemote(reason=reason):
            facts = {"reason": reason}
        case (
            DomainStateChanged(from_state=old, to_state=new)
            | DomainNotReady(from_state=old, to_state=new)
            | DomainHeartbeatFailed(from_state=old, to_state=new)
            | DomainDegradedEscalated(from_state=old, to_state=new)
        ):
            facts = {"from": old.value, "to": new.value}
        case SlotStateChanged(kind=kind, from_state=old, to_state=new):
            facts = {"from": old, "to": new, "kind": kind.value}
        case RoutingSwitched(route_revision=revision):
            facts = {"routeRevision": revision}
        case DomainSupervisorUnauthorized(message=message):
            facts = {"message": message}
        case _:
            facts = {}
    return " ".join(f"{key}={value}" for key, value in facts.items() if value is not None)


def render_view(state: ViewState, *, now: datetime | None = None) -> RenderableType:
    """The whole live view as one renderable (pure: no I/O)."""
    at = now or datetime.now(UTC)
    fleet = state.fleet
    header = Text()
    header.append("Haru demo", style="bold")
    if fleet is not None:
        header.append(f"  fleet {fleet.slug}  route revision {fleet.route_revision}")
        header.append(f"  autoFailover {'on' if fleet.policy.auto_failover else 'off'}")
    header.append(f"\nserver {state.server_url}  (OpenAI API at {state.server_url}/v1)")
    if state.phase:
        header.append("\nphase: ")
        header.append(state.phase, style="bold cyan")
    if state.error:
        header.append(f"\nserver unreachable: {state.error}", style="red")
    parts: list[RenderableType] = [header]
    if fleet is not None:
        parts.append(_domains_table(fleet, state.served, at))
    parts.append(Panel(_operation_text(state, at), title="operation", title_align="left"))
    if state.traffic is not None:
        summary = state.traffic
        line = Text(f"demo traffic: {summary.ok} ok, ")
        line.append(f"{summary.failed} failed", style="bold red" if summary.failed else "")
        line.append(f", {summary.stale} served stale")
        line.append(f", {state.rate:.0f} req/s" if state.traffic_running else " (stopped)")
        parts.append(line)
    parts.append(Panel(_events_table(state), title="recent events", title_align="left"))
    return Group(*parts)


def step_durations(events: Iterable[Event], operation_id: UUID) -> list[tuple[str, float]]:
    """Seconds each step of an operation took, from its audit events.

    A step starts when the previous one's ``operation.step.done`` lands (the first one at
    ``operation.started``) and ends with its own.
    """
    mark: datetime | None = None
    durations: list[tuple[str, float]] = []
    for event in sorted(events, key=lambda e: e.id):
        if event.operation_id != operation_id:
            continue
        data = event.data
        if isinstance(data, OperationStarted):
            mark = event.created_at
        elif isinstance(data, OperationStepDone) and mark is not None:
            durations.append((data.step.value, (event.created_at - mark).total_seconds()))
            mark = event.created_at
    return durations


class FleetWatcher:
    """Keeps a :class:`ViewState` fresh by polling the server and the emulated vLLM servers.

    Args:
        state: The state to update.
        fleet: Fleet reference.
        control: An open control API client.
        session: An open aiohttp session (for ``/_sim/state``).
        vllm_urls: Emulated vLLM base URLs per domain slug.
        traffic: The demo's own traffic, if any.
        interval_s: Pause between polls.
    """

    def __init__(
        self,
        state: ViewState,
        *,
        fleet: str,
        control: ControlClient,
        session: aiohttp.ClientSession,
        vllm_urls: Mapping[str, Sequence[str]],
        traffic: ChatTraffic | None = None,
        interval_s: float = 0.25,
    ) -> None:
        self.state = state
        self.fleet = fleet
        self.control = control
        self.session = session
        self.vllm_urls = vllm_urls
        self.traffic = traffic
        self.interval_s = interval_s
        self.all_events: list[Event] = []
        self._cursor = 0
        self._served_last: dict[str, int] = {}
        self._served_base: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def poll(self) -> None:
        """One refresh of everything (failures are shown, never raised)."""
        try:
            self.state.fleet = await self.control.fleet(self.fleet)
            await self._poll_events()
            await self._poll_operation()
            self.state.error = None
        except ControlApiError as exc:
            self.state.error = str(exc)
        await self._poll_served()
        if self.traffic is not None:
            self.state.traffic = self.traffic.summary()
            self.state.rate = self.traffic.rate()
            self.state.traffic_running = self.traffic.running

    async def _poll_events(self) -> None:
        while True:
            page = await self.control.events(self.fleet, after=self._cursor, limit=200)
            for event in page.events:
                self.all_events.append(event)
                self.state.events.append(event)
                self._cursor = event.id
            if page.next_after is None:
                return

    async def _poll_operation(self) -> None:
        latest = next(
            (e.operation_id for e in reversed(self.all_events) if e.operation_id is not None),
            None,
        )
        if latest is not None:
            self.state.operation = await self.control.operation(self.fleet, latest)

    async def _served_by(self, url: str) -> int | None:
        try:
            async with (
                asyncio.timeout(_SIM_STATE_TIMEOUT_S),
                self.session.get(f"{url}/_sim/state") as response,
            ):
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        counters = body.get("counters", {}) if isinstance(body, dict) else {}
        requests = counters.get("requests", {}) if isinstance(counters, dict) else {}
        value = requests.get(_CHAT_PATH, 0) if isinstance(requests, dict) else 0
        return value if isinstance(value, int) else None

    async def _poll_served(self) -> None:
        urls = [(slug, url) for slug, group in self.vllm_urls.items() for url in group]
        counts = await asyncio.gather(*(self._served_by(url) for _slug, url in urls))
        for (_slug, url), count in zip(urls, counts, strict=True):
            # A killed server keeps the count it last reported; a restarted one starts over
            # from zero, so what it had counted before is carried as a base.
            if count is None:
                continue
            last = self._served_last.get(url, 0)
            if count < last:
                self._served_base[url] = self._served_base.get(url, 0) + last
            self._served_last[url] = count
        totals: dict[str, int] = {}
        for slug, url in urls:
            served = self._served_base.get(url, 0) + self._served_last.get(url, 0)
            totals[slug] = totals.get(slug, 0) + served
        self.state.served = totals

    def start(self) -> None:
        """Poll in the background until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="haru-demo-watcher")

    async def stop(self) -> None:
        """Stop polling."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
