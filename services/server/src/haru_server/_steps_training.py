"""The training-side steps (DESIGN 7.3): stop training, verify the GPUs freed, start training.

``stop_training`` asks the target's supervisor to stop its training runs and proves them idle
(``haru_core.training_not_idle``); ``verify_gpu`` proves the GPUs released their memory
(``haru_core.gpus_not_released``), naming who still holds a GPU when the budget runs out;
:func:`train_domain` (``start_training``, and ``demote_old_train`` on the former active)
starts training and proves it running (``haru_core.training_not_running``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from haru_core import (
    GPU_RELEASED_RATIO,
    gpus_not_released,
    training_not_idle,
    training_not_running,
    training_slots,
)
from haru_db import SlotMirror
from haru_protocol import (
    DomainSnapshot,
    EventType,
    GpuMemoryResponse,
    GpuUsage,
    OperationErrorCode,
    OperationStep,
    OperationStepDone,
    SlotKind,
    SupervisorStatus,
    TrainingSlotState,
    TrainingStopFact,
)
from haru_supervisor_client import HEARTBEAT_TIMEOUT_S, SupervisorCallError

from haru_server._steps_base import (
    TO_IDLE,
    TO_STOPPING,
    Done,
    Failed,
    Pending,
    StepContext,
    StepResult,
    apply_mirror,
    done_field,
    poll_until,
    read_fence,
    read_status,
    step_log_fields,
    supervisor_call,
    supervisor_url,
)

logger = logging.getLogger(__name__)

_TS = TrainingSlotState
_S = OperationStep


async def stop_training(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not training_slots(target):
        return Done(OperationStepDone(step=ctx.step, skipped="no training slots"))
    url = supervisor_url(target)
    fence = await read_fence(ctx)
    if not ctx.entered:
        await apply_mirror(ctx, target, TO_STOPPING)
    automatic = await _is_automatic(ctx)
    policy = ctx.fleet.policy
    grace = policy.failover_training_stop_grace_ms if automatic else policy.training_stop_grace_ms
    await supervisor_call(
        ctx,
        ctx.client.stop_training(
            url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S), grace_ms=grace, fence=fence
        ),
        target_side=True,
    )
    last: list[SupervisorStatus] = []

    async def fetch() -> SupervisorStatus:
        status = await read_status(ctx, target)
        last[:] = [status]
        return status

    busy = await poll_until(
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
    return Done(detail, mirror=TO_IDLE)


async def _is_automatic(ctx: StepContext) -> bool:
    """Whether the operation is an automatic failover (the reconciler created it).

    Its ``operation.auto_failover`` event, appended by the operation's own insert,
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
            "cannot list the processes holding GPU(s) %s: %s", held, exc, extra=step_log_fields(ctx)
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


async def verify_gpu(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not training_slots(target):
        return Done(OperationStepDone(step=ctx.step, skipped="no training slots"))
    url = supervisor_url(target)
    last: list[GpuMemoryResponse] = []

    async def fetch() -> GpuMemoryResponse:
        memory = await ctx.client.gpu_memory(url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S))
        last[:] = [memory]
        return memory

    # This tick's polling reaches the end of the budget: fail now, naming who holds the GPU,
    # rather than leave the reconciler a bare step_timeout.
    last_tick = time.monotonic() + ctx.tuning.settle_s >= ctx.deadline
    held = await poll_until(
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


async def train_domain(ctx: StepContext, domain: DomainSnapshot) -> StepResult:
    if not training_slots(domain):
        return Done(
            OperationStepDone(step=ctx.step, domain_id=domain.id, skipped="no training slots")
        )
    url = supervisor_url(domain)
    target_side = domain.id == ctx.target.id
    status = await supervisor_call(ctx, read_status(ctx, domain), target_side=target_side)
    idle: Sequence[object] = training_not_running(domain, status)
    # Already running: that status poll is the proof.
    if idle:
        fence = await read_fence(ctx)
        await supervisor_call(
            ctx,
            ctx.client.start_training(url, timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S), fence=fence),
            target_side=target_side,
        )
        idle = await poll_until(
            ctx,
            lambda: read_status(ctx, domain),
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
        count_into=done_field("training_slots_training"),
    )
    return Done(OperationStepDone(step=ctx.step, domain_id=domain.id), mirror=mirror)


async def start_training(ctx: StepContext) -> StepResult:
    return await train_domain(ctx, ctx.target)
