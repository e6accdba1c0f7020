"""Step executors of promote and demote (DESIGN 7.3): each is re-runnable and proves its result.

An executor runs once per tick. It acts on a supervisor (idempotently), polls the
supervisor's status for PROOF and returns :class:`Done` only on that proof. Every supervisor
failure, timeout or malformed answer makes the step :class:`Pending` (the next tick tries
again until the step's budget runs out), except a 401/403 from the TARGET's supervisor,
which fails the step ``supervisor_unauthorized``. Source-side steps (``demote_old_*``) never
fail. Every supervisor call is bounded by what remains of the step's budget.

Every state-changing supervisor call (sleep, wake, training start and stop) carries the
step's fencing token, read from the store just before it (``StateStore.get_operation_fence``):
a process that lost the step (the operation moved on) calls nothing, and a supervisor that
has seen a newer token refuses the call (``409 stale_fence``); either way the step stays
pending and the next tick starts from the operation as the store has it.

Executors only mirror slot states (guarded CAS from-lists that the proof justifies); moving
the operation itself is the reconciler's job (one CAS per step result). A step's last slot move
(the one its proof justifies) is returned with :class:`Done` and rides that CAS; a step's first
move (:func:`entry_mirror`) rides the CAS that started the step when the same tick runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar, assert_never
from uuid import UUID

from haru_core import (
    GPU_RELEASED_RATIO,
    gpus_not_released,
    inference_bindings,
    lease_guard_ms,
    models_not_in,
    training_not_idle,
    training_not_running,
    training_slots,
)
from haru_db import SlotMirror, StateStore
from haru_protocol import (
    DomainSnapshot,
    EventType,
    FailedModel,
    FleetRoutePointer,
    FleetSnapshot,
    GpuMemoryResponse,
    GpuUsage,
    InferenceSlotState,
    Operation,
    OperationErrorCode,
    OperationKind,
    OperationStep,
    OperationStepDone,
    Provider,
    RoutingSwitched,
    SlotKind,
    SupervisorFence,
    SupervisorStatus,
    TrainingSlotState,
    TrainingStopFact,
)
from haru_supervisor_client import (
    HEARTBEAT_TIMEOUT_S,
    SupervisorCallError,
    SupervisorClient,
    SupervisorStaleFenceError,
    SupervisorUnauthorizedError,
)

from haru_server._logfields import log_fields

if TYPE_CHECKING:
    from haru_server._proxy import InferenceProxy

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_I = InferenceSlotState
_TS = TrainingSlotState
_S = OperationStep

DRAIN_SHARE = 0.75
"""Share of the remaining budget the old active may spend draining before it sleeps."""

_SLEEP_MIRROR_FROM = (_I.SERVING, _I.PROBING, _I.WAKING, _I.FAILED)
"""Inference states that a proven sleep moves to ``sleeping`` (``failed`` too: the proof
repairs it exactly as a standby heartbeat would)."""


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Done:
    """The step's effect is proven; the operation may move on.

    Attributes:
        detail: The ``operation.step.done`` event, with the facts that prove the step.
        complete: End the operation after this step even if the plan has more steps.
        degrade_source: A best-effort step timed out: degrade the source domain.
        mirror: The slot move the proof justifies, applied by the same statement as the
            operation's CAS (its count lands in ``detail`` under the mirror's ``count_into``).
    """

    detail: OperationStepDone
    complete: bool = False
    degrade_source: bool = False
    mirror: SlotMirror | None = None


@dataclass(frozen=True, slots=True)
class Pending:
    """Not proven yet; nothing is written to the operation row."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The step failed for good; the operation fails with this code.

    Attributes:
        failed_models: ``probe_failed``: each model that failed, for the
            ``operation.failed`` event.
    """

    code: OperationErrorCode
    message: str
    failed_models: tuple[FailedModel, ...] | None = None


StepResult = Done | Pending | Failed


class _Outcome(Exception):  # noqa: N818  # control flow inside one executor, never escapes
    def __init__(self, result: Pending | Failed) -> None:
        super().__init__(result)
        self.result = result


# ---- context ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepTuning:
    """How long an executor keeps polling for its proof after acting.

    Attributes:
        settle_s: Poll for up to this long (bounded by the step's budget) before answering
            pending, so a proof that lands a few milliseconds after the action is seen in
            the same tick instead of one loop interval later. 0 = a single poll.
        first_poll_s: First pause between polls; it doubles up to ``max_poll_s``.
        max_poll_s: Longest pause between polls.
        route_guard_s: A step that sleeps a former active (``demote_old_sleep``, and
            ``sleep_vllm`` of a domain a promotion flipped away from) stays pending until this
            long after the flip, on the reconcile clock: every process's route lease has run
            out by then (``haru_core.lease_guard_ms``; see the README). The
            fleet's stored ``route_lease_ms`` (the longest lease any process records, read
            after the flip) lengthens it. See :func:`route_guard_until`.
    """

    settle_s: float = 1.0
    first_poll_s: float = 0.005
    max_poll_s: float = 0.015
    route_guard_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepContext:
    """Everything one executor run needs."""

    store: StateStore
    client: SupervisorClient
    tuning: StepTuning
    fleet: FleetSnapshot
    operation: Operation
    step: OperationStep
    target: DomainSnapshot
    now: datetime
    remaining_ms: int
    deadline: float
    """``time.monotonic()`` at which the step's budget runs out."""
    entered: bool = False
    """The CAS that started this step already applied its :func:`entry_mirror`."""
    guard_until: datetime | None = None
    """:func:`route_guard_until` of this step: it sleeps nothing before then."""
    proxy: InferenceProxy | None = None
    """This process's inference proxy, told of a flip made here so it routes with it at once."""

    def bound(self, cap_s: float | None = None) -> float:
        """Seconds a supervisor call may take: what remains of the budget, capped."""
        left = max(0.0, self.deadline - time.monotonic())
        return left if cap_s is None else min(left, cap_s)

    def remaining_now_ms(self) -> int:
        """Milliseconds of budget left right now."""
        return int(self.bound() * 1000)

    @property
    def source(self) -> DomainSnapshot | None:
        """The domain that was active when the operation was created, unless it is the target."""
        source_id = self.operation.source_domain_id
        if source_id is None or source_id == self.target.id:
            return None
        return self.fleet.domain(source_id)


# ---- supervisor calls with the step rules ----------------------------------------------------


def _supervisor_url(domain: DomainSnapshot) -> str:
    if domain.supervisor_url is None:
        raise _Outcome(Pending(f"domain {domain.slug!r} has no supervisor URL"))
    return domain.supervisor_url


async def _fence(ctx: StepContext) -> SupervisorFence:
    """The fencing token of the step, read just before a state-changing supervisor call.

    None from the store means the operation has left the step (another process advanced or
    failed it): this process lost the claim and acts no more.
    """
    token = await ctx.store.get_operation_fence(ctx.operation.id, ctx.step)
    if token is None:
        raise _Outcome(
            Pending(
                f"lost the claim: operation {ctx.operation.id} is no longer at {ctx.step.value}"
            )
        )
    return SupervisorFence(ctx.fleet.id, token)


def _fields(ctx: StepContext) -> dict[str, str]:
    return log_fields(ctx.fleet, domain=ctx.target, operation=ctx.operation, step=ctx.step)


async def _call(ctx: StepContext, call: Awaitable[_T], *, target_side: bool) -> _T:
    try:
        return await call
    except SupervisorUnauthorizedError as exc:
        if target_side:
            raise _Outcome(Failed(OperationErrorCode.SUPERVISOR_UNAUTHORIZED, str(exc))) from exc
        raise _Outcome(Pending(str(exc))) from exc
    except SupervisorStaleFenceError as exc:
        # Another process wrote the operation since this one read its token: never retried,
        # the next tick starts from the operation as the store has it.
        logger.warning(
            "operation %s: lost the claim on %s: %s",
            ctx.operation.id,
            ctx.step.value,
            exc,
            extra=_fields(ctx),
        )
        raise _Outcome(Pending(f"lost the claim: {exc}")) from exc
    except SupervisorCallError as exc:
        raise _Outcome(Pending(str(exc))) from exc


async def _poll_until(
    ctx: StepContext,
    fetch: Callable[[], Awaitable[_T]],
    unproven: Callable[[_T], Sequence[object]],
    *,
    target_side: bool,
) -> Sequence[object]:
    """Poll ``fetch`` until ``unproven`` is empty or the settle window closes.

    Returns:
        What is still unproven after the last poll (empty: proven).
    """
    settle_end = min(time.monotonic() + ctx.tuning.settle_s, ctx.deadline)
    pause = ctx.tuning.first_poll_s
    while True:
        missing = unproven(await _call(ctx, fetch(), target_side=target_side))
        if not missing or time.monotonic() + pause >= settle_end:
            return missing
        await asyncio.sleep(pause)
        pause = min(pause * 2, ctx.tuning.max_poll_s)


async def _status(ctx: StepContext, domain: DomainSnapshot) -> SupervisorStatus:
    return await ctx.client.status(
        _supervisor_url(domain), timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S)
    )


async def _apply(ctx: StepContext, domain: DomainSnapshot, mirror: SlotMirror) -> int:
    """Apply a step's first slot move on its own (the CAS that started the step did not)."""
    return await ctx.store.transition_domain_slots(
        domain.id, kind=mirror.kind, from_states=mirror.from_states, to=mirror.to, at=ctx.now
    )


def _field(name: str) -> str:
    """The wire name of an ``operation.step.done`` field (where a mirror's count goes)."""
    alias = OperationStepDone.model_fields[name].serialization_alias
    return alias if alias is not None else name


_STOPPING = SlotMirror(SlotKind.TRAINING, (_TS.TRAINING,), _TS.STOPPING)
_IDLE = SlotMirror(
    SlotKind.TRAINING,
    (_TS.STOPPING, _TS.TRAINING),
    _TS.IDLE,
    count_into=_field("training_slots_idle"),
)
_WAKING = SlotMirror(SlotKind.INFERENCE, (_I.SLEEPING, _I.FAILED), _I.WAKING)
_PROBING = SlotMirror(SlotKind.INFERENCE, (_I.WAKING,), _I.PROBING)
_SERVING = SlotMirror(SlotKind.INFERENCE, (_I.PROBING,), _I.SERVING)


def entry_mirror(step: OperationStep, target: DomainSnapshot) -> SlotMirror | None:
    """The first slot move of ``step`` on ``target``, or None when the step starts with none.

    ``stop_training`` mirrors the training slots to ``stopping`` and ``wake_vllm`` the
    inference slots to ``waking``, both before calling the supervisor, and only when the
    executor would get that far (training slots, inference bindings, a supervisor URL). The
    reconciler sends it with the CAS that starts the step when the same tick runs the step
    (``StepContext.entered``); a step run by a later tick mirrors it itself.
    """
    if target.supervisor_url is None:
        return None
    if step is _S.STOP_TRAINING and training_slots(target):
        return _STOPPING
    if step is _S.WAKE_VLLM and inference_bindings(target):
        return _WAKING
    return None


# ---- executors -------------------------------------------------------------------------------


async def _stop_training(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not training_slots(target):
        return Done(OperationStepDone(step=ctx.step, skipped="no training slots"))
    url = _supervisor_url(target)
    fence = await _fence(ctx)
    if not ctx.entered:
        await _apply(ctx, target, _STOPPING)
    automatic = await _is_automatic(ctx)
    policy = ctx.fleet.policy
    grace = policy.failover_training_stop_grace_ms if automatic else policy.training_stop_grace_ms
    await _call(
        ctx,
        ctx.client.stop_training(
            url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S), grace_ms=grace, fence=fence
        ),
        target_side=True,
    )
    last: list[SupervisorStatus] = []

    async def fetch() -> SupervisorStatus:
        status = await _status(ctx, target)
        last[:] = [status]
        return status

    busy = await _poll_until(
        ctx, fetch, lambda status: training_not_idle(target, status), target_side=True
    )
    if busy:
        return Pending(f"training still running on GPU(s) {busy}")
    detail = OperationStepDone(
        step=ctx.step,
        automatic=automatic,
        grace_ms=grace,
        training_stops=training_stops(target, last[0]) or None,
    )
    return Done(detail, mirror=_IDLE)


async def _is_automatic(ctx: StepContext) -> bool:
    """Whether the operation is an automatic failover (the reconciler created it).

    Its ``operation.auto_failover`` event, appended right after the operation was created,
    says so: the newest such event of the target domain names this operation.
    """
    events = await ctx.store.list_domain_events(
        ctx.fleet.id, ctx.target.id, types=(EventType.OPERATION_AUTO_FAILOVER.value,), limit=1
    )
    return bool(events) and events[0].operation_id == ctx.operation.id


def training_stops(
    domain: DomainSnapshot, status: SupervisorStatus
) -> tuple[TrainingStopFact, ...]:
    """How each of the layout's training runs last stopped, as its supervisor measured it."""
    gpus = {s.gpu_index for s in training_slots(domain)}
    return tuple(
        TrainingStopFact(
            gpu_index=slot.gpu_index,
            stop_ms=slot.training.last_stop.stop_ms,
            killed=slot.training.last_stop.killed,
        )
        for slot in status.slots
        if slot.gpu_index in gpus
        and slot.kind is SlotKind.TRAINING
        and slot.training is not None
        and slot.training.last_stop is not None
    )


HOLDERS_TIMEOUT_S = 2.0
"""Bound of the call naming the processes on held GPUs (diagnostic: it may overrun the budget)."""


async def _gpu_holders(ctx: StepContext, url: str, held: Sequence[object]) -> str:
    """``; held by ...`` naming the compute processes on ``held`` GPUs, or "" when unknown."""
    try:
        answer = await ctx.client.gpu_processes(url, timeout_s=HOLDERS_TIMEOUT_S)
    except SupervisorCallError as exc:  # an older supervisor (404) or a failed listing
        logger.debug(
            "cannot list the processes holding GPU(s) %s: %s", held, exc, extra=_fields(ctx)
        )
        return ""
    parts: list[str] = []
    for gpu in answer.gpus:
        if gpu.index not in held or gpu.processes is None:
            continue
        names = [
            f"pid {p.pid}"
            + (f" {p.name}" if p.name else "")
            + (f" {p.used_mib:.0f} MiB" if p.used_mib is not None else "")
            for p in gpu.processes
        ]
        parts.append(f"GPU {gpu.index}: " + (", ".join(names) or "no compute process listed"))
    return f"; held by {'; '.join(parts)}" if parts else ""


async def _verify_gpu(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not training_slots(target):
        return Done(OperationStepDone(step=ctx.step, skipped="no training slots"))
    url = _supervisor_url(target)
    last: list[GpuMemoryResponse] = []

    async def fetch() -> GpuMemoryResponse:
        memory = await ctx.client.gpu_memory(url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S))
        last[:] = [memory]
        return memory

    # This tick's polling reaches the end of the budget: fail now, naming who holds the GPU,
    # rather than leave the reconciler a bare step_timeout.
    last_tick = time.monotonic() + ctx.tuning.settle_s >= ctx.deadline
    held = await _poll_until(
        ctx, fetch, lambda memory: gpus_not_released(target, memory), target_side=True
    )
    if held:
        reason = f"GPU(s) {held} still hold more than {GPU_RELEASED_RATIO:.0%} of memory"
        reason += await _gpu_holders(ctx, url, held)
        if last_tick:
            return Failed(
                OperationErrorCode.STEP_TIMEOUT,
                f"step {_S.VERIFY_GPU.value} did not finish within its budget: {reason}",
            )
        return Pending(reason)
    gpus = tuple(
        GpuUsage(index=g.index, used_mib=g.used_mib, total_mib=g.total_mib) for g in last[0].gpus
    )
    return Done(OperationStepDone(step=ctx.step, gpus=gpus))


async def _wake_vllm(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not inference_bindings(target):
        return Failed(
            OperationErrorCode.NO_INFERENCE_BINDINGS,
            f"domain {target.slug!r} has no inference slot with a model binding",
        )
    url = _supervisor_url(target)
    fence = await _fence(ctx)
    if not ctx.entered:
        await _apply(ctx, target, _WAKING)
    # Waking an awake vLLM is a harmless no-op, so no status read first (sleep differs:
    # sleeping again aborts queued requests).
    await _call(ctx, ctx.client.wake(url, timeout_s=ctx.bound(), fence=fence), target_side=True)
    asleep = await _poll_until(
        ctx,
        lambda: _status(ctx, target),
        lambda status: models_not_in(target, status, asleep=False),
        target_side=True,
    )
    if asleep:
        return Pending(f"model(s) not proven awake: {asleep}")
    models = tuple(b.name for b in inference_bindings(target))
    return Done(OperationStepDone(step=ctx.step, models=models), mirror=_PROBING)


async def _probe(ctx: StepContext) -> StepResult:
    target = ctx.target
    url = _supervisor_url(target)
    # A supervisor restarted since the wake (its vLLM servers still starting, or their state
    # not read yet) cannot prove them awake: that is "not ready yet", retried within the
    # budget (step_timeout at its end), not a probe_failed naming models that never answered.
    status = await _call(ctx, _status(ctx, target), target_side=True)
    not_ready = models_not_in(target, status, asleep=False)
    if not_ready:
        return Pending(f"model(s) not ready yet (not reported awake): {not_ready}")
    probe = ctx.fleet.policy.probe
    response = await _call(
        ctx,
        # The client gives each model a bound comfortably inside this one, so a slow model
        # comes back as a failed result naming it.
        ctx.client.probe(
            url, timeout_s=ctx.bound(), prompt=probe.prompt, max_tokens=probe.max_tokens
        ),
        target_side=True,
    )
    results = {r.model: r for r in response.results}
    failed: list[FailedModel] = []
    latencies: dict[str, float] = {}
    for binding in inference_bindings(target):
        result = results.get(binding.name)
        if result is None:
            failed.append(FailedModel(model=binding.name, error="never probed"))
        elif not result.ok:
            failed.append(FailedModel(model=binding.name, error=result.error or "failed"))
        else:
            latencies[binding.name] = result.latency_ms
    if failed:
        problems = ", ".join(f"{f.model} ({f.error})" for f in failed)
        return Failed(OperationErrorCode.PROBE_FAILED, "probe failed: " + problems, tuple(failed))
    return Done(OperationStepDone(step=ctx.step, latency_ms=latencies), mirror=_SERVING)


async def _fresh_pointer(ctx: StepContext) -> FleetRoutePointer:
    """The route pointer as the store has it now, never the tick's snapshot of it.

    A process paused inside a tick resumes with a snapshot that another process may have made
    stale by a whole operation: a decision about who is active reads the pointer itself.
    """
    pointer = await ctx.store.get_fleet_route_pointer(str(ctx.fleet.id))
    if pointer is None:
        raise _Outcome(Pending("the fleet's route pointer is gone"))
    return pointer


async def _switch_active(ctx: StepContext) -> StepResult:
    fleet, op, target = ctx.fleet, ctx.operation, ctx.target
    current = await _fresh_pointer(ctx)
    if current.active_domain_id == target.id:
        return Done(
            OperationStepDone(
                step=ctx.step, already_active=True, route_revision=current.route_revision
            )
        )
    switched = await ctx.store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=op.source_domain_id,
        target_domain_id=target.id,
        operation_id=op.id,
        at=ctx.now,
    )
    pointer = await ctx.store.get_fleet_route_pointer(str(fleet.id))
    revision = None if pointer is None else pointer.route_revision
    if pointer is not None and ctx.proxy is not None:
        ctx.proxy.note_route_move(pointer)
    if switched:
        await ctx.store.append_event(
            fleet_id=fleet.id,
            payload=RoutingSwitched(
                from_domain_id=op.source_domain_id,
                to_domain_id=target.id,
                route_revision=revision,
            ),
            at=ctx.now,
            domain_id=target.id,
            operation_id=op.id,
        )
        return Done(OperationStepDone(step=ctx.step, route_revision=revision))
    if pointer is not None and pointer.active_domain_id == target.id:
        return Done(OperationStepDone(step=ctx.step, route_revision=revision))
    where = "gone" if pointer is None else _str(pointer.active_domain_id)
    return Failed(
        OperationErrorCode.CAS_LOST,
        f"routing pointer is {where}, expected {_str(op.source_domain_id)}; not switched",
    )


async def _sleep_domain(ctx: StepContext, domain: DomainSnapshot, *, drain: bool) -> StepResult:
    url = _supervisor_url(domain)
    target_side = domain.id == ctx.target.id
    status = await _call(ctx, _status(ctx, domain), target_side=target_side)
    awake: Sequence[object] = models_not_in(domain, status, asleep=True)
    # Already asleep: that status poll is the proof (polling again would prove nothing new).
    if awake:
        fence = await _fence(ctx)
        remaining = ctx.remaining_now_ms()
        drain_ms = max(1, int(remaining * DRAIN_SHARE)) if drain and remaining > 1 else None
        await _call(
            ctx,
            ctx.client.sleep(url, timeout_s=ctx.bound(), drain_timeout_ms=drain_ms, fence=fence),
            target_side=target_side,
        )
        awake = await _poll_until(
            ctx,
            lambda: _status(ctx, domain),
            lambda status: models_not_in(domain, status, asleep=True),
            target_side=target_side,
        )
    if awake:
        return Pending(f"model(s) not proven asleep on {domain.slug!r}: {awake}")
    mirror = SlotMirror(
        SlotKind.INFERENCE,
        _SLEEP_MIRROR_FROM,
        _I.SLEEPING,
        on_source=not target_side,
        count_into=_field("inference_slots_sleeping"),
    )
    return Done(OperationStepDone(step=ctx.step, domain_id=domain.id), mirror=mirror)


async def _train_domain(ctx: StepContext, domain: DomainSnapshot) -> StepResult:
    if not training_slots(domain):
        return Done(
            OperationStepDone(step=ctx.step, domain_id=domain.id, skipped="no training slots")
        )
    url = _supervisor_url(domain)
    target_side = domain.id == ctx.target.id
    status = await _call(ctx, _status(ctx, domain), target_side=target_side)
    idle: Sequence[object] = training_not_running(domain, status)
    # Already running: that status poll is the proof.
    if idle:
        fence = await _fence(ctx)
        await _call(
            ctx,
            ctx.client.start_training(url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S), fence=fence),
            target_side=target_side,
        )
        idle = await _poll_until(
            ctx,
            lambda: _status(ctx, domain),
            lambda status: training_not_running(domain, status),
            target_side=target_side,
        )
    if idle:
        return Pending(f"training not proven running on {domain.slug!r} GPU(s) {idle}")
    mirror = SlotMirror(
        SlotKind.TRAINING,
        (_TS.IDLE, _TS.STOPPING),
        _TS.TRAINING,
        on_source=not target_side,
        count_into=_field("training_slots_training"),
    )
    return Done(OperationStepDone(step=ctx.step, domain_id=domain.id), mirror=mirror)


_ALWAYS_AWAKE = "the previous active is a skyserve domain (always awake, no supervisor)"


def _route_guard(ctx: StepContext) -> Pending | None:
    """Pending while processes may still route to the domain this step would sleep."""
    until = ctx.guard_until
    if until is None or ctx.now >= until:
        return None
    left = (until - ctx.now).total_seconds()
    return Pending(f"every route lease runs out in {left:.3f} s (route guard)")


async def _guard_s(store: StateStore, tuning: StepTuning, fleet_id: UUID) -> float:
    """The route guard after a flip: this process's own, or the longest lease recorded.

    Read after the flip (whatever snapshot the tick holds): a process whose pointer predates
    the flip recorded its lease before it read that pointer.
    """
    stored = await store.get_route_lease_ms(fleet_id)
    if stored is None:
        return tuning.route_guard_s
    return max(tuning.route_guard_s, lease_guard_ms(stored) / 1000)


async def _flipped_at(store: StateStore, promote: Operation, now: datetime) -> datetime:
    """When ``promote`` moved the routing pointer (its ``routing.switched`` event).

    Without that event (a process died between the flip and its event), the latest time it
    can have happened: the promotion's end.
    """
    events = await store.list_domain_events(
        promote.fleet_id,
        promote.target_domain_id,
        types=(EventType.ROUTING_SWITCHED.value,),
        limit=8,
    )
    for event in events:
        if event.operation_id == promote.id:
            return event.created_at
    return promote.finished_at or now


async def former_active_guard_until(
    store: StateStore,
    tuning: StepTuning,
    fleet_id: UUID,
    domain_id: UUID,
    *,
    since: datetime,
    now: datetime,
    recent_limit: int = 64,
) -> datetime | None:
    """Until when a process may still route to ``domain_id``, a former active.

    The fleet's newest committed promotion away from it flipped the pointer at some time; the
    guard (:func:`_guard_s`) runs from then. None when it never was the source of one, or
    when the guard was over before ``since`` (judged from the promotion's end, no later than
    its flip, so without reading its event).
    """
    recent = await store.list_recent_operations(fleet_id, limit=recent_limit)
    promote = next(
        (
            op
            for op in sorted(recent, key=lambda op: op.created_at, reverse=True)
            if op.kind is OperationKind.PROMOTE
            and op.routing_committed
            and op.source_domain_id == domain_id
            and op.target_domain_id != domain_id
        ),
        None,
    )
    if promote is None:
        return None
    guard = timedelta(seconds=await _guard_s(store, tuning, fleet_id))
    if (promote.finished_at or now) + guard <= since:
        return None
    return await _flipped_at(store, promote, now) + guard


async def route_guard_until(
    store: StateStore,
    tuning: StepTuning,
    fleet: FleetSnapshot,
    operation: Operation,
    step: OperationStep,
    now: datetime,
    *,
    recent_limit: int = 64,
) -> datetime | None:
    """Until when a process may still route to the domain ``step`` would sleep (None: never).

    The domain is one a promotion flipped the pointer away from: ``demote_old_sleep``'s source
    (flipped when the step started), or the target of a demote's ``sleep_vllm`` when the
    fleet's newest committed promotion away from it flipped less than a guard ago (a restore
    demote queued by another replica whose budget ran out, say). A sleep before then would
    reach a vLLM server that some process still routes requests to. The reconciler adds the
    wait to the step's budget, so a guard longer than ``sleepTimeoutMs`` never times the step
    out (and so never queues a restore demote that would sleep the old active at once).
    """
    flipped: datetime | None
    if step is _S.DEMOTE_OLD_SLEEP:
        source_id = operation.source_domain_id
        source = None if source_id is None else fleet.domain(source_id)
        if source is None or source.id == operation.target_domain_id:
            return None
        if source.provider is Provider.SKYSERVE:
            return None
        flipped = operation.step_started_at
        if flipped is None:
            return None
        own = flipped + timedelta(seconds=tuning.route_guard_s)
        if now < own:
            return own  # pending anyway: the store is read once this process's guard passed
    elif step is _S.SLEEP_VLLM:
        return await former_active_guard_until(
            store,
            tuning,
            fleet.id,
            operation.target_domain_id,
            since=operation.step_started_at or now,
            now=now,
            recent_limit=recent_limit,
        )
    else:
        return None
    return flipped + timedelta(seconds=await _guard_s(store, tuning, fleet.id))


async def _demote_old_sleep(ctx: StepContext) -> StepResult:
    source = ctx.source
    if source is None:
        return Done(OperationStepDone(step=ctx.step, skipped="no previous active domain"))
    if source.provider is Provider.SKYSERVE:
        return Done(OperationStepDone(step=ctx.step, domain_id=source.id, skipped=_ALWAYS_AWAKE))
    guarded = _route_guard(ctx)
    if guarded is not None:
        return guarded
    if (await _fresh_pointer(ctx)).active_domain_id == source.id:
        # Routing names the previous active again (this operation never moved it, or a later
        # one moved it back while this process stood still): never sleep the domain that
        # serves, and never train beside its awake vLLM.
        return Done(
            OperationStepDone(
                step=ctx.step, domain_id=source.id, skipped="the previous active is routed to"
            ),
            complete=True,
        )
    return await _sleep_domain(ctx, source, drain=True)


async def _demote_old_train(ctx: StepContext) -> StepResult:
    source = ctx.source
    if source is None:
        return Done(OperationStepDone(step=ctx.step, skipped="no previous active domain"))
    if source.provider is Provider.SKYSERVE:
        return Done(OperationStepDone(step=ctx.step, domain_id=source.id, skipped=_ALWAYS_AWAKE))
    return await _train_domain(ctx, source)


async def _sleep_vllm(ctx: StepContext) -> StepResult:
    if (await _fresh_pointer(ctx)).active_domain_id == ctx.target.id:
        return Failed(
            OperationErrorCode.TARGET_IS_ACTIVE,
            f"domain {ctx.target.slug!r} became the active domain; it cannot be put to sleep",
        )
    guarded = _route_guard(ctx)
    if guarded is not None:
        return guarded
    return await _sleep_domain(ctx, ctx.target, drain=False)


async def _start_training(ctx: StepContext) -> StepResult:
    return await _train_domain(ctx, ctx.target)


async def run_step(ctx: StepContext) -> StepResult:
    """Run the executor of ``ctx.step`` once and return its result.

    A supervisor failure never raises (it is a result); state-store failures propagate.
    """
    try:
        return await _execute(ctx)
    except _Outcome as outcome:
        return outcome.result


async def _execute(ctx: StepContext) -> StepResult:
    match ctx.step:
        case _S.STOP_TRAINING:
            return await _stop_training(ctx)
        case _S.VERIFY_GPU:
            return await _verify_gpu(ctx)
        case _S.WAKE_VLLM:
            return await _wake_vllm(ctx)
        case _S.PROBE:
            return await _probe(ctx)
        case _S.SWITCH_ACTIVE:
            return await _switch_active(ctx)
        case _S.DEMOTE_OLD_SLEEP:
            return await _demote_old_sleep(ctx)
        case _S.DEMOTE_OLD_TRAIN:
            return await _demote_old_train(ctx)
        case _S.SLEEP_VLLM:
            return await _sleep_vllm(ctx)
        case _S.START_TRAINING:
            return await _start_training(ctx)
        case _:
            assert_never(ctx.step)


def _str(value: UUID | None) -> str | None:
    return None if value is None else str(value)
