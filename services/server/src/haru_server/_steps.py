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

This module dispatches a step to its executor (:func:`run_step`). The executors live by side:
:mod:`haru_server._steps_training` (stop training, verify the GPUs, start training),
:mod:`haru_server._steps_serving` (wake, probe, switch routing) and
:mod:`haru_server._steps_sleep` (the sleeps and the route guard); what they share (results,
context, supervisor calls with the step rules, slot mirrors) is in
:mod:`haru_server._steps_base`.
"""

from __future__ import annotations

from typing import assert_never

from haru_protocol import OperationStep

from haru_server._steps_base import (
    Done,
    Failed,
    Pending,
    StepContext,
    StepOutcome,
    StepResult,
    StepTuning,
    entry_mirror,
)
from haru_server._steps_serving import probe_models, switch_active, wake_vllm
from haru_server._steps_sleep import (
    demote_old_sleep,
    demote_old_train,
    former_active_guard_until,
    route_guard_until,
    sleep_vllm,
)
from haru_server._steps_training import start_training, stop_training, verify_gpu

__all__ = (
    "Done",
    "Failed",
    "Pending",
    "StepContext",
    "StepResult",
    "StepTuning",
    "entry_mirror",
    "former_active_guard_until",
    "route_guard_until",
    "run_step",
)

_S = OperationStep


async def run_step(ctx: StepContext) -> StepResult:
    """Run the executor of ``ctx.step`` once and return its result.

    A supervisor failure never raises (it is a result); state-store failures propagate.
    """
    try:
        return await _execute(ctx)
    except StepOutcome as outcome:
        return outcome.result


async def _execute(ctx: StepContext) -> StepResult:
    match ctx.step:
        case _S.STOP_TRAINING:
            return await stop_training(ctx)
        case _S.VERIFY_GPU:
            return await verify_gpu(ctx)
        case _S.WAKE_VLLM:
            return await wake_vllm(ctx)
        case _S.PROBE:
            return await probe_models(ctx)
        case _S.SWITCH_ACTIVE:
            return await switch_active(ctx)
        case _S.DEMOTE_OLD_SLEEP:
            return await demote_old_sleep(ctx)
        case _S.DEMOTE_OLD_TRAIN:
            return await demote_old_train(ctx)
        case _S.SLEEP_VLLM:
            return await sleep_vllm(ctx)
        case _S.START_TRAINING:
            return await start_training(ctx)
        case _:
            assert_never(ctx.step)
