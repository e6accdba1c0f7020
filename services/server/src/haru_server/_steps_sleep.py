"""The sleep steps and the route guard (DESIGN 7.3): put a domain's vLLM to sleep, never early.

``demote_old_sleep`` (drains, then sleeps the former active), ``demote_old_train`` and
``sleep_vllm`` prove the models asleep (``haru_core.models_not_in``). A domain a promotion
flipped routing away from sleeps only after every process's route lease has run out:
:func:`route_guard_until` says until when, and the reconciler adds that wait to the step's
budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from uuid import UUID

from haru_core import clamp_to_now, lease_guard_ms, models_not_in
from haru_db import SlotMirror, StateStore
from haru_protocol import (
    DomainSnapshot,
    EventType,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    OperationErrorCode,
    OperationKind,
    OperationStep,
    OperationStepDone,
    Provider,
    SlotKind,
)

from haru_server._steps_base import (
    Done,
    Failed,
    Pending,
    StepContext,
    StepResult,
    StepTuning,
    done_field,
    fresh_pointer,
    poll_until,
    read_fence,
    read_status,
    supervisor_call,
    supervisor_url,
)
from haru_server._steps_training import train_domain

_I = InferenceSlotState
_S = OperationStep


DRAIN_SHARE = 0.75
"""Share of the remaining budget the old active may spend draining before it sleeps."""

_SLEEP_MIRROR_FROM = (_I.SERVING, _I.PROBING, _I.WAKING, _I.FAILED)
"""Inference states that a proven sleep moves to ``sleeping`` (``failed`` too: the proof
repairs it exactly as a standby heartbeat would)."""


async def _sleep_domain(ctx: StepContext, domain: DomainSnapshot, *, drain: bool) -> StepResult:
    url = supervisor_url(domain)
    target_side = domain.id == ctx.target.id
    status = await supervisor_call(ctx, read_status(ctx, domain), target_side=target_side)
    awake: Sequence[object] = models_not_in(domain, status, asleep=True)
    # Already asleep: that status poll is the proof (polling again would prove nothing new).
    if awake:
        fence = await read_fence(ctx)
        remaining = ctx.remaining_now_ms()
        drain_ms = max(1, int(remaining * DRAIN_SHARE)) if drain and remaining > 1 else None
        await supervisor_call(
            ctx,
            ctx.client.sleep(url, timeout_s=ctx.bound(), drain_timeout_ms=drain_ms, fence=fence),
            target_side=target_side,
        )
        awake = await poll_until(
            ctx,
            lambda: read_status(ctx, domain),
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
        count_into=done_field("inference_slots_sleeping"),
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
    can have happened: the promotion's end. A stored time ahead of ``now`` counts as ``now``
    (the flip has happened: it is no later than now).
    """
    events = await store.list_domain_events(
        promote.fleet_id,
        promote.target_domain_id,
        types=(EventType.ROUTING_SWITCHED.value,),
        limit=8,
    )
    for event in events:
        if event.operation_id == promote.id:
            return clamp_to_now(event.created_at, now=now)
    return clamp_to_now(promote.finished_at or now, now=now)


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
    if clamp_to_now(promote.finished_at or now, now=now) + guard <= since:
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
        if operation.step_started_at is None:
            return None
        flipped = clamp_to_now(operation.step_started_at, now=now)
        own = flipped + timedelta(seconds=tuning.route_guard_s)
        if now < own:
            return own  # pending anyway: the store is read once this process's guard passed
    elif step is _S.SLEEP_VLLM:
        return await former_active_guard_until(
            store,
            tuning,
            fleet.id,
            operation.target_domain_id,
            since=clamp_to_now(operation.step_started_at or now, now=now),
            now=now,
            recent_limit=recent_limit,
        )
    else:
        return None
    return flipped + timedelta(seconds=await _guard_s(store, tuning, fleet.id))


async def demote_old_sleep(ctx: StepContext) -> StepResult:
    source = ctx.source
    if source is None:
        return Done(OperationStepDone(step=ctx.step, skipped="no previous active domain"))
    if source.provider is Provider.SKYSERVE:
        return Done(OperationStepDone(step=ctx.step, domain_id=source.id, skipped=_ALWAYS_AWAKE))
    guarded = _route_guard(ctx)
    if guarded is not None:
        return guarded
    if (await fresh_pointer(ctx)).active_domain_id == source.id:
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


async def demote_old_train(ctx: StepContext) -> StepResult:
    source = ctx.source
    if source is None:
        return Done(OperationStepDone(step=ctx.step, skipped="no previous active domain"))
    if source.provider is Provider.SKYSERVE:
        return Done(OperationStepDone(step=ctx.step, domain_id=source.id, skipped=_ALWAYS_AWAKE))
    return await train_domain(ctx, source)


async def sleep_vllm(ctx: StepContext) -> StepResult:
    if (await fresh_pointer(ctx)).active_domain_id == ctx.target.id:
        return Failed(
            OperationErrorCode.TARGET_IS_ACTIVE,
            f"domain {ctx.target.slug!r} became the active domain; it cannot be put to sleep",
        )
    guarded = _route_guard(ctx)
    if guarded is not None:
        return guarded
    return await _sleep_domain(ctx, ctx.target, drain=False)
