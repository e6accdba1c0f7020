"""Standby posture: a standby out of it gets a demote (DESIGN 7.3, beyond).

A standby's posture is vLLM asleep and training running. A supervisor restart stops its
trainers (and a trainer may die); the heartbeat then mirrors the training slot to ``idle`` and
no operation would ever start it again. A promotion whose best-effort ``demote_old_sleep`` ran
out of budget while the old active was ``failed`` (not demotable, so its restore demote was
refused) leaves that domain awake once it is ``ready`` again. :func:`detect_restores` finds such
standbys so the reconciler can queue a demote (which proves vLLM asleep and starts training; a
provisioned standby gets its first one the same way once its launch made it ready)
once the supervisor confirms what the store shows (:func:`restore_confirmed`), and
:func:`restore_backoff` spaces those demotes per target so a trainer that cannot start, or a
vLLM that keeps waking, is not retried at tick rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    OperationKind,
    OperationState,
    Policy,
    Provider,
    SlotKind,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotState,
)

from haru_core._backoff import PromotionBackoff, backoff_delay_ms, in_backoff
from haru_core._bindings import (
    has_inference_bindings,
    inference_bindings,
    inference_slots,
    is_active,
    training_slots,
)
from haru_core._heartbeat import model_sleep_states
from haru_core._time import clamp_to_now, require_aware

RESTORE_REASON_TRAINING_IDLE = "training_idle"
"""The ``reason`` of a restore demote queued because a standby's training stopped."""

RESTORE_REASON_VLLM_AWAKE = "vllm_awake"
"""The ``reason`` of a restore demote queued because a standby's vLLM servers are awake."""


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    """Queue a demote of ``target_domain_id`` to bring it back to standby posture."""

    target_domain_id: UUID
    reason: str


def is_out_of_posture(fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
    """Whether ``domain`` is a standby asleep with a training slot idle (its training stopped).

    Only a standby the server can act on counts: not the active, ``ready`` (so confirmed, not
    provisioning), a supervisor URL that accepts the server's token, inference bindings, every
    inference slot ``sleeping`` (an inference slot in any other state is a failover's or a
    heartbeat's business, not this one's), and at least one training slot ``idle``.
    """
    return (
        _drivable_standby(fleet, domain)
        and all(s.state is InferenceSlotState.SLEEPING for s in inference_slots(domain))
        and any(s.state is TrainingSlotState.IDLE for s in training_slots(domain))
    )


def _drivable_standby(fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
    return (
        not is_active(fleet, domain)
        and domain.state is DomainState.READY
        and not domain.auth_failing
        and domain.supervisor_url is not None
        and has_inference_bindings(domain)  # so it has an inference slot too
    )


def may_be_awake_standby(fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
    """Whether ``domain`` is a standby whose recorded slots say a vLLM server may be awake.

    A ready standby the server can act on (as in :func:`is_out_of_posture`) whose inference
    slots are all ``sleeping`` or ``failed``, at least one ``failed``: the heartbeat records a
    standby's inference slot ``failed`` when a bound model does not report asleep, which is
    an awake vLLM (out of posture) or a crashed or hung one (nothing a demote could fix). Only
    the supervisor can tell them apart (:func:`restore_confirmed`). A slot in a transitional
    state (``waking``, ``probing``, ...) belongs to an operation or the next heartbeat.
    """
    infer = inference_slots(domain)
    return (
        _drivable_standby(fleet, domain)
        and all(s.state in (InferenceSlotState.SLEEPING, InferenceSlotState.FAILED) for s in infer)
        and any(s.state is InferenceSlotState.FAILED for s in infer)
    )


def awake_standbys(fleet: FleetSnapshot) -> tuple[DomainSnapshot, ...]:
    """The standbys of ``fleet`` that may be awake (:func:`may_be_awake_standby`), by slug."""
    return tuple(
        sorted((d for d in fleet.domains if may_be_awake_standby(fleet, d)), key=lambda d: d.slug)
    )


def restore_confirmed(domain: DomainSnapshot, status: SupervisorStatus, reason: str) -> bool:
    """Whether the supervisor's answer ``status`` confirms a restore demote of ``domain``.

    - ``training_idle``: a training run of the domain is idle.
    - ``vllm_awake``: every model the layout binds answers (asleep or awake) and at least one
      reports awake. A model that does not answer (a crashed or hung vLLM) never confirms: a
      demote could not sleep it and would hold the fleet's one in-flight operation for its
      ``sleepTimeoutMs``, blocking failovers, for nothing.

    Any other reason is never confirmed.
    """
    if reason == RESTORE_REASON_TRAINING_IDLE:
        return any(
            slot.training is not None and slot.training.state is TrainingRunState.IDLE
            for slot in status.slots
            if slot.kind is SlotKind.TRAINING
        )
    if reason == RESTORE_REASON_VLLM_AWAKE:
        sleeping = model_sleep_states(status)
        answers = [sleeping.get(b.name) for b in inference_bindings(domain)]
        return bool(answers) and None not in answers and False in answers
    return False


def restore_candidates(fleet: FleetSnapshot) -> tuple[DomainSnapshot, ...]:
    """The standbys of ``fleet`` out of posture (:func:`is_out_of_posture`), by slug."""
    return tuple(
        sorted((d for d in fleet.domains if is_out_of_posture(fleet, d)), key=lambda d: d.slug)
    )


def restore_backoff(
    policy: Policy,
    target_domain_id: UUID,
    operations: Iterable[Operation],
    *,
    now: datetime | None = None,
) -> PromotionBackoff | None:
    """How long a new restore demote of ``target_domain_id`` waits, from recent ``operations``.

    Finished operations involving the target count newest first: consecutive demotes of it
    (succeeded or failed: a trainer that starts and dies again is as much a loop as one that
    never starts) until a promote of it, or until a succeeded promote of another domain away
    from it, which counts as the first of them (its tail demoted the target). The first of
    them (the operation that put it in posture) pauses nothing; ``n >= 2`` pause
    ``promotionBackoffBaseMs * 2^(n-2)`` (bounded by ``promotionBackoffMaxMs``) from the end
    of the newest. So a first loss of posture is restored at once, and a loop waits ever
    longer.

    Returns:
        The backoff (``consecutive_failures``: the restore demotes so far), or None when the
        target's newest finished operations hold fewer than two consecutive demotes.
    """
    finished = sorted(
        (
            op
            for op in operations
            if target_domain_id in (op.target_domain_id, op.source_domain_id)
            and op.state in (OperationState.FAILED, OperationState.SUCCEEDED)
            and op.finished_at is not None
        ),
        key=lambda op: (op.finished_at or op.created_at, op.created_at),
        reverse=True,
    )
    demotes = 0
    for op in finished:
        if op.kind is OperationKind.DEMOTE and op.target_domain_id == target_domain_id:
            demotes += 1
            continue
        if _promoted_away(op, target_domain_id):
            demotes += 1
        break
    restores = demotes - 1
    if restores < 1:
        return None
    last = finished[0].finished_at or finished[0].created_at  # finished: filtered above
    if now is not None:
        last = clamp_to_now(last, now=now)
    delay = backoff_delay_ms(policy, restores)
    return PromotionBackoff(
        target_domain_id=target_domain_id,
        consecutive_failures=restores,
        delay_ms=delay,
        until=last + timedelta(milliseconds=delay),
    )


def reached_standby_posture(domain_id: UUID, operations: Iterable[Operation]) -> bool:
    """Whether the newest finished operation involving ``domain_id`` left it in standby posture.

    That is a demote of it (succeeded, or failed: a restore that must be retried), a
    succeeded promote of another domain with it as the source (the promote's tail demoted it),
    or a failed promote of it (its failure queues a restore demote, which is refused while
    the domain is not demotable, e.g. ``failed``: it is owed one).
    A domain no operation ever demoted (a fresh fleet's standby: training slots start
    ``idle``) never had training to restore; its first demote stays the operator's call.
    """
    involving = sorted(
        (
            op
            for op in operations
            if domain_id in (op.target_domain_id, op.source_domain_id)
            and op.state in (OperationState.FAILED, OperationState.SUCCEEDED)
            and op.finished_at is not None
        ),
        key=lambda op: (op.finished_at or op.created_at, op.created_at),
        reverse=True,
    )
    if not involving:
        return False
    newest = involving[0]
    if newest.kind is OperationKind.DEMOTE:
        return newest.target_domain_id == domain_id
    if newest.target_domain_id == domain_id:
        return newest.state is OperationState.FAILED
    return _promoted_away(newest, domain_id)


def _promoted_away(op: Operation, domain_id: UUID) -> bool:
    return (
        op.kind is OperationKind.PROMOTE
        and op.state is OperationState.SUCCEEDED
        and op.source_domain_id == domain_id
        and op.target_domain_id != domain_id
    )


def launched_as_standby(domain: DomainSnapshot) -> bool:
    """Whether Haru launched ``domain`` (a provisioned one) and it is a standby now.

    Haru launched it to take its place in the fleet: a standby's place is the full posture,
    training included, so its first demote is Haru's, not the operator's (the launch put its
    vLLM servers to sleep; nothing else starts its training).
    """
    return domain.provider is not Provider.STATIC and domain.launched_at is not None


def detect_restores(
    fleet: FleetSnapshot, operations: Iterable[Operation], *, now: datetime
) -> tuple[RestoreDecision, ...]:
    """Every standby owed a restore demote whose restore demotes do not back off, in order.

    A candidate is out of posture after having reached it (:func:`reached_standby_posture`),
    or was launched by Haru as a standby (:func:`launched_as_standby`):
    asleep with its training stopped (:func:`is_out_of_posture`, reason ``training_idle``),
    then, after those, possibly awake (:func:`may_be_awake_standby`, reason ``vllm_awake``).
    The caller checks that no operation is in flight (the demote would otherwise race it),
    passes the fleet's recent operations, and queues the first decision the supervisor
    confirms (:func:`restore_confirmed`).
    """
    require_aware("now", now)
    recent = tuple(operations)
    decisions = []
    for reason, domains in (
        (RESTORE_REASON_TRAINING_IDLE, restore_candidates(fleet)),
        (RESTORE_REASON_VLLM_AWAKE, awake_standbys(fleet)),
    ):
        for domain in domains:
            if not (launched_as_standby(domain) or reached_standby_posture(domain.id, recent)):
                continue
            backoff = restore_backoff(fleet.policy, domain.id, recent, now=now)
            if not in_backoff(None if backoff is None else backoff.until, now=now):
                decisions.append(RestoreDecision(target_domain_id=domain.id, reason=reason))
    return tuple(decisions)


def detect_restore(
    fleet: FleetSnapshot, operations: Iterable[Operation], *, now: datetime
) -> RestoreDecision | None:
    """The first of :func:`detect_restores`, or None."""
    decisions = detect_restores(fleet, operations, now=now)
    return decisions[0] if decisions else None
