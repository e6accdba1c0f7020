"""Queueing an operation: create it with its event (or join the in-flight one), count, log.

Every operation starts here, whoever asks for it: a promote or demote request (``manual``),
the reconciler's automatic failover (``automatic``) and its restore demotes (``restore``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Literal
from uuid import UUID

from haru_db import StateStore
from haru_protocol import (
    EventPayload,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationRestoreDemote,
)

from haru_server._logfields import log_fields
from haru_server._metrics import ServerMetrics

logger = logging.getLogger(__name__)

Trigger = Literal["manual", "automatic", "restore"]
"""Who asked for the operation (the ``trigger`` label of ``haru_operations_requested``)."""


async def request_operation(
    store: StateStore,
    metrics: ServerMetrics,
    fleet: FleetSnapshot,
    *,
    kind: OperationKind,
    target_domain_id: UUID,
    at: datetime,
    trigger: Trigger,
    why: str,
    event: Callable[[Operation], EventPayload],
) -> tuple[Operation, bool]:
    """Create a pending operation, or join the fleet's in-flight one.

    A created operation is recorded by the event ``event`` builds from it, appended by the
    operation's own insert (so no operation is ever without it), then counted and logged
    (``why``: what asked for it). A joined one adds no event.

    Returns:
        ``(operation, True)`` when created; ``(in_flight_operation, False)`` when another
        operation was already in flight (whatever its kind and target).
    """
    operation, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=kind,
        target_domain_id=target_domain_id,
        at=at,
        events=lambda created: (event(created),),
    )
    if not created:
        return operation, False
    metrics.operation_requested(kind.value, trigger)
    target = fleet.domain(target_domain_id)
    logger.log(
        logging.INFO if trigger == "manual" else logging.WARNING,
        "fleet %s: %s of domain %s queued (%s; operation %s)",
        fleet.slug,
        kind.value,
        target_domain_id if target is None else target.slug,
        why,
        operation.id,
        extra=log_fields(fleet, operation=operation),
    )
    return operation, True


async def request_restore_demote(
    store: StateStore,
    metrics: ServerMetrics,
    fleet: FleetSnapshot,
    target_domain_id: UUID,
    *,
    at: datetime,
    why: str,
    cause_operation_id: UUID | None,
    reason: str,
) -> tuple[Operation, bool]:
    """Queue a demote that returns a standby to its posture, as :func:`request_operation`.

    ``cause_operation_id``: the operation whose failure or timeout left the domain out of
    posture (None: the heartbeats found it so); ``reason``: what is out of posture.
    """
    return await request_operation(
        store,
        metrics,
        fleet,
        kind=OperationKind.DEMOTE,
        target_domain_id=target_domain_id,
        at=at,
        trigger="restore",
        why=why,
        event=lambda _: OperationRestoreDemote(
            cause_operation_id=cause_operation_id,
            target_domain_id=target_domain_id,
            reason=reason,
        ),
    )
