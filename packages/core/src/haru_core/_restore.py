"""Standby posture: a standby whose training stopped by itself gets a demote (SPEC 7.3, beyond).

A standby's posture is vLLM asleep and training running. A supervisor restart stops its
trainers (and a trainer may die); the heartbeat then mirrors the training slot to ``idle`` and
no operation would ever start it again. :func:`detect_restore` finds such a standby so the
reconciler can queue a demote (which proves vLLM asleep and starts training; a provisioned
standby gets its first one the same way once its launch made it ready), and
:func:`restore_backoff` spaces those demotes per target so a trainer that cannot start is not
retried at tick rate.
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
    TrainingSlotState,
)

from haru_core._backoff import PromotionBackoff, backoff_delay_ms, in_backoff
from haru_core._bindings import has_inference_bindings, inference_slots, is_active, training_slots
from haru_core._time import require_aware

RESTORE_REASON_TRAINING_IDLE = "training_idle"
"""The ``reason`` of a restore demote queued because a standby's training stopped."""


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
    infer = inference_slots(domain)
    return (
        not is_active(fleet, domain)
        and domain.state is DomainState.READY
        and not domain.auth_failing
        and domain.supervisor_url is not None
        and has_inference_bindings(domain)
        and bool(infer)
        and all(s.state is InferenceSlotState.SLEEPING for s in infer)
        and any(s.state is TrainingSlotState.IDLE for s in training_slots(domain))
    )


def restore_candidates(fleet: FleetSnapshot) -> tuple[DomainSnapshot, ...]:
    """The standbys of ``fleet`` out of posture (:func:`is_out_of_posture`), by slug."""
    return tuple(
        sorted((d for d in fleet.domains if is_out_of_posture(fleet, d)), key=lambda d: d.slug)
    )


def restore_backoff(
    policy: Policy, target_domain_id: UUID, operations: Iterable[Operation]
) -> PromotionBackoff | None:
    """How long a new restore demote of ``target_domain_id`` waits, from recent ``operations``.

    Finished operations of the target count newest first: consecutive demotes (succeeded or
    failed: a trainer that starts and dies again is as much a loop as one that never starts)
    until a promote of it. The first of them (the demote that put it in posture) pauses
    nothing; ``n >= 2`` pause ``promotionBackoffBaseMs * 2^(n-2)`` (bounded by
    ``promotionBackoffMaxMs``) from the end of the newest. So a first loss of training is
    restored at once, and a loop waits ever longer.

    Returns:
        The backoff (``consecutive_failures``: the restore demotes so far), or None when the
        target's newest finished operations hold fewer than two consecutive demotes.
    """
    finished = sorted(
        (
            op
            for op in operations
            if op.target_domain_id == target_domain_id
            and op.state in (OperationState.FAILED, OperationState.SUCCEEDED)
            and op.finished_at is not None
        ),
        key=lambda op: (op.finished_at or op.created_at, op.created_at),
        reverse=True,
    )
    demotes = 0
    for op in finished:
        if op.kind is not OperationKind.DEMOTE:
            break
        demotes += 1
    restores = demotes - 1
    if restores < 1:
        return None
    last = finished[0].finished_at or finished[0].created_at  # finished: filtered above
    delay = backoff_delay_ms(policy, restores)
    return PromotionBackoff(
        target_domain_id=target_domain_id,
        consecutive_failures=restores,
        delay_ms=delay,
        until=last + timedelta(milliseconds=delay),
    )


def reached_standby_posture(domain_id: UUID, operations: Iterable[Operation]) -> bool:
    """Whether the newest finished operation involving ``domain_id`` left it in standby posture.

    That is a demote of it (succeeded, or failed: a restore that must be retried), or a
    succeeded promote of another domain with it as the source (the promote's tail demoted it).
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
    return (
        newest.state is OperationState.SUCCEEDED
        and newest.source_domain_id == domain_id
        and newest.target_domain_id != domain_id
    )


def launched_as_standby(domain: DomainSnapshot) -> bool:
    """Whether Haru launched ``domain`` (a provisioned one) and it is a standby now.

    Haru launched it to take its place in the fleet: a standby's place is the full posture,
    training included, so its first demote is Haru's, not the operator's (the launch put its
    vLLM servers to sleep; nothing else starts its training).
    """
    return domain.provider is not Provider.STATIC and domain.launched_at is not None


def detect_restore(
    fleet: FleetSnapshot, operations: Iterable[Operation], *, now: datetime
) -> RestoreDecision | None:
    """The first standby that lost its training and whose restore demotes do not back off.

    A candidate is out of posture (:func:`is_out_of_posture`) after having reached it
    (:func:`reached_standby_posture`), or was launched by Haru as a standby
    (:func:`launched_as_standby`). The caller checks that no operation is in flight (the
    demote would otherwise race it) and passes the fleet's recent operations.
    """
    require_aware("now", now)
    recent = tuple(operations)
    for domain in restore_candidates(fleet):
        if not (launched_as_standby(domain) or reached_standby_posture(domain.id, recent)):
            continue
        backoff = restore_backoff(fleet.policy, domain.id, recent)
        if not in_backoff(None if backoff is None else backoff.until, now=now):
            return RestoreDecision(target_domain_id=domain.id, reason=RESTORE_REASON_TRAINING_IDLE)
    return None
