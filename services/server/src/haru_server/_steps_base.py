"""What every step executor shares (DESIGN 7.3): results, context, supervisor calls, slot mirrors.

:class:`Done`, :class:`Pending` and :class:`Failed` are what an executor answers;
:class:`StepContext` is what it runs with. :func:`supervisor_call` applies the step rules to a
supervisor call (a 401/403 from the TARGET's supervisor fails the step, every other failure
leaves it pending, a stale fence means the claim is lost), :func:`read_fence` reads the step's
fencing token just before a state-changing call, :func:`poll_until` polls for a proof within
the settle window. The slot mirrors (``TO_*``) are the guarded moves the proofs justify, and
:func:`entry_mirror` names a step's first move, which rides the CAS that starts the step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from haru_core import inference_bindings, training_slots
from haru_db import SlotMirror, StateStore
from haru_protocol import (
    DomainSnapshot,
    FailedModel,
    FleetRoutePointer,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    OperationErrorCode,
    OperationStep,
    OperationStepDone,
    SlotKind,
    SupervisorFence,
    SupervisorStatus,
    TrainingSlotState,
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


class StepOutcome(Exception):  # noqa: N818  # control flow inside one executor, never escapes
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


def supervisor_url(domain: DomainSnapshot) -> str:
    if domain.supervisor_url is None:
        raise StepOutcome(Pending(f"domain {domain.slug!r} has no supervisor URL"))
    return domain.supervisor_url


async def read_fence(ctx: StepContext) -> SupervisorFence:
    """The fencing token of the step, read just before a state-changing supervisor call.

    None from the store means the operation has left the step (another process advanced or
    failed it): this process lost the claim and acts no more.
    """
    token = await ctx.store.get_operation_fence(ctx.operation.id, ctx.step)
    if token is None:
        raise StepOutcome(
            Pending(
                f"lost the claim: operation {ctx.operation.id} is no longer at {ctx.step.value}"
            )
        )
    return SupervisorFence(ctx.fleet.id, token)


def step_log_fields(ctx: StepContext) -> dict[str, str]:
    return log_fields(ctx.fleet, domain=ctx.target, operation=ctx.operation, step=ctx.step)


async def supervisor_call(ctx: StepContext, call: Awaitable[_T], *, target_side: bool) -> _T:
    try:
        return await call
    except SupervisorUnauthorizedError as exc:
        if target_side:
            raise StepOutcome(Failed(OperationErrorCode.SUPERVISOR_UNAUTHORIZED, str(exc))) from exc
        raise StepOutcome(Pending(str(exc))) from exc
    except SupervisorStaleFenceError as exc:
        # Another process wrote the operation since this one read its token: never retried,
        # the next tick starts from the operation as the store has it.
        logger.warning(
            "operation %s: lost the claim on %s: %s",
            ctx.operation.id,
            ctx.step.value,
            exc,
            extra=step_log_fields(ctx),
        )
        raise StepOutcome(Pending(f"lost the claim: {exc}")) from exc
    except SupervisorCallError as exc:
        raise StepOutcome(Pending(str(exc))) from exc


async def poll_until(
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
        missing = unproven(await supervisor_call(ctx, fetch(), target_side=target_side))
        if not missing or time.monotonic() + pause >= settle_end:
            return missing
        await asyncio.sleep(pause)
        pause = min(pause * 2, ctx.tuning.max_poll_s)


async def read_status(ctx: StepContext, domain: DomainSnapshot) -> SupervisorStatus:
    return await ctx.client.status(supervisor_url(domain), timeout_s=ctx.bound(HEARTBEAT_TIMEOUT_S))


async def apply_mirror(ctx: StepContext, domain: DomainSnapshot, mirror: SlotMirror) -> int:
    """Apply a step's first slot move on its own (the CAS that started the step did not)."""
    return await ctx.store.transition_domain_slots(
        domain.id, kind=mirror.kind, from_states=mirror.from_states, to=mirror.to, at=ctx.now
    )


def done_field(name: str) -> str:
    """The wire name of an ``operation.step.done`` field (where a mirror's count goes)."""
    alias = OperationStepDone.model_fields[name].serialization_alias
    return alias if alias is not None else name


TO_STOPPING = SlotMirror(SlotKind.TRAINING, (_TS.TRAINING,), _TS.STOPPING)
TO_IDLE = SlotMirror(
    SlotKind.TRAINING,
    (_TS.STOPPING, _TS.TRAINING),
    _TS.IDLE,
    count_into=done_field("training_slots_idle"),
)
TO_WAKING = SlotMirror(SlotKind.INFERENCE, (_I.SLEEPING, _I.FAILED), _I.WAKING)
TO_PROBING = SlotMirror(SlotKind.INFERENCE, (_I.WAKING,), _I.PROBING)
TO_SERVING = SlotMirror(SlotKind.INFERENCE, (_I.PROBING,), _I.SERVING)


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
        return TO_STOPPING
    if step is _S.WAKE_VLLM and inference_bindings(target):
        return TO_WAKING
    return None


async def fresh_pointer(ctx: StepContext) -> FleetRoutePointer:
    """The route pointer as the store has it now, never the tick's snapshot of it.

    A process paused inside a tick resumes with a snapshot that another process may have made
    stale by a whole operation: a decision about who is active reads the pointer itself.
    """
    pointer = await ctx.store.get_fleet_route_pointer(str(ctx.fleet.id))
    if pointer is None:
        raise StepOutcome(Pending("the fleet's route pointer is gone"))
    return pointer
