"""The state store's operation writes and its audit log (part of :class:`~haru_db.StateStore`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from uuid import UUID

from haru_protocol import (
    Event,
    EventPayload,
    Operation,
    OperationError,
    OperationKind,
    OperationStep,
)

from haru_db import (
    _events,
    _operations,
)
from haru_db._events import OperationEvent
from haru_db._facade import Facade, bounded
from haru_db._mirrors import SlotMirror


class OperationWrites(Facade):
    """Create, claim, advance, complete, fail and switch; append and page events."""

    # ---- operations ------------------------------------------------------------------------

    @bounded
    async def create_operation(
        self,
        *,
        fleet_id: UUID,
        kind: OperationKind,
        target_domain_id: UUID,
        at: datetime,
        events: Callable[[Operation], Sequence[EventPayload]] | None = None,
    ) -> tuple[Operation, bool]:
        """Insert a pending operation, or join the fleet's in-flight one.

        The source domain is the fleet's routing pointer, read just before the insert; the
        insert lands only while the pointer is still there (otherwise it is tried again).
        ``events`` builds, from the operation about to be inserted, the events the insert
        appends in its own statement (with the operation's fleet, target domain, id and
        creation time): a created operation always has them, a joined one adds none.

        Returns:
            ``(operation, True)`` when created; ``(in_flight_operation, False)`` when another
            operation was already in flight (whatever its kind and target).

        Raises:
            ConstraintViolationError: Unknown fleet, or a target outside the fleet.
        """
        return await _operations.create_operation(
            self._ex,
            fleet_id=fleet_id,
            kind=kind,
            target_domain_id=target_domain_id,
            at=at,
            events=events,
        )

    @bounded
    async def claim_operation(
        self,
        operation_id: UUID,
        *,
        first_step: OperationStep,
        at: datetime,
        events: Sequence[OperationEvent] = (),
        entry_mirror: SlotMirror | None = None,
    ) -> int | None:
        """Start a pending operation at ``first_step`` (pending -> running).

        ``events`` are appended, then ``entry_mirror`` (the first step's first slot move) is
        applied, in the same statement, only when the claim lands (see :class:`OperationEvent`
        and :class:`SlotMirror`).

        Returns:
            The fleet's fence after the claim (the token of ``first_step``, see
            :meth:`get_operation_fence`), or None when the claim did not land.
        """
        return await _operations.claim_operation(
            self._ex,
            operation_id,
            first_step=first_step,
            at=at,
            events=events,
            entry_mirror=entry_mirror,
        )

    @bounded
    async def advance_step(
        self,
        operation_id: UUID,
        *,
        from_step: OperationStep,
        to_step: OperationStep,
        at: datetime,
        events: Sequence[OperationEvent] = (),
        exit_mirror: SlotMirror | None = None,
        entry_mirror: SlotMirror | None = None,
    ) -> int | None:
        """Move a running operation from ``from_step`` to ``to_step`` (restarting the budget).

        Only when the advance lands, the same statement applies ``exit_mirror`` (the slot move
        that ``from_step``'s proof justifies), appends ``events`` (typically the step's
        ``operation.step.done``, which gets the exit mirror's count under its ``count_into``
        key) and applies ``entry_mirror`` (``to_step``'s first slot move), in that order.

        Returns:
            The fleet's fence after the advance (the token of ``to_step``), or None when the
            advance did not land.

        Raises:
            ValueError: Both mirrors move the same slots.
            haru_core.InvalidTransitionError: A mirror's from-state cannot move to its state.
        """
        return await _operations.advance_step(
            self._ex,
            operation_id,
            from_step=from_step,
            to_step=to_step,
            at=at,
            events=events,
            exit_mirror=exit_mirror,
            entry_mirror=entry_mirror,
        )

    @bounded
    async def complete_operation(
        self,
        operation_id: UUID,
        *,
        from_step: OperationStep,
        at: datetime,
        events: Sequence[OperationEvent] = (),
        exit_mirror: SlotMirror | None = None,
    ) -> bool:
        """Finish a running operation at ``from_step`` as succeeded.

        Only when it lands, the same statement applies ``exit_mirror`` and appends ``events``
        in order (as :meth:`advance_step`).
        """
        return await _operations.complete_operation(
            self._ex,
            operation_id,
            from_step=from_step,
            at=at,
            events=events,
            exit_mirror=exit_mirror,
        )

    @bounded
    async def fail_operation(
        self,
        operation_id: UUID,
        *,
        error: OperationError,
        at: datetime,
        expected_step: OperationStep | None = None,
        target_not_routed: bool = False,
        events: Sequence[OperationEvent] = (),
    ) -> bool:
        """Fail an in-flight operation; for a promote, clean up its target in the same statement.

        ``events`` are appended by that statement too (about the operation and its target),
        only when the fail lands.

        Guards: state pending or running; ``current_step == expected_step`` when given;
        ``routing_committed = false`` when ``target_not_routed``. For a promote the same
        statement fails the target's inference slots in ``waking``/``probing`` (and
        ``serving`` unless the pointer is at the target) and returns its ``stopping`` training
        slots to ``training``, so a retry never observes half-cleaned state.
        """
        return await _operations.fail_operation(
            self._ex,
            operation_id,
            error=error,
            at=at,
            expected_step=expected_step,
            target_not_routed=target_not_routed,
            events=events,
        )

    @bounded
    async def switch_active(
        self,
        *,
        fleet_id: UUID,
        expected_active_domain_id: UUID | None,
        target_domain_id: UUID,
        operation_id: UUID,
        at: datetime,
    ) -> bool:
        """Move the routing pointer to ``target_domain_id`` for a running operation.

        One statement moves the pointer, bumps ``route_revision`` and marks the operation
        ``routing_committed``, only while the pointer equals ``expected_active_domain_id``
        (``None`` = unset) and the operation is running in this fleet.

        Raises:
            ConstraintViolationError: The target is not a domain of the fleet.
        """
        return await _operations.switch_active(
            self._ex,
            fleet_id=fleet_id,
            expected_active_domain_id=expected_active_domain_id,
            target_domain_id=target_domain_id,
            operation_id=operation_id,
            at=at,
        )

    # ---- events ----------------------------------------------------------------------------

    @bounded
    async def append_event(
        self,
        *,
        fleet_id: UUID,
        payload: EventPayload | Mapping[str, object],
        at: datetime,
        type: str | None = None,
        domain_id: UUID | None = None,
        slot_id: UUID | None = None,
        operation_id: UUID | None = None,
    ) -> int:
        """Append one audit event.

        ``payload`` is a typed :class:`haru_protocol.EventPayload` (its model names the type)
        or, for a type without a model, a JSON object with ``type``.

        Returns:
            The event id (increasing; pass the last one seen as ``after`` to
            :meth:`list_events`).

        Raises:
            TypeError: ``payload`` is not strict JSON (a datetime, NaN, ...).
            ValueError: ``type`` is empty or longer than 128 characters, missing for a raw
                payload, disagrees with a typed one, or its model refuses the raw payload.
            ConstraintViolationError: An unknown fleet, domain, slot or operation id.
        """
        return await _events.append_event(
            self._ex,
            fleet_id=fleet_id,
            type=type,
            payload=payload,
            at=at,
            domain_id=domain_id,
            slot_id=slot_id,
            operation_id=operation_id,
        )

    @bounded
    async def list_events(self, fleet_id: UUID, *, after: int = 0, limit: int = 100) -> list[Event]:
        """Events of a fleet with ``id > after``, oldest first, at most ``limit`` (<= 1000)."""
        return await _events.list_events(self._ex, fleet_id, after=after, limit=limit)

    @bounded
    async def list_domain_events(
        self,
        fleet_id: UUID,
        domain_id: UUID,
        *,
        types: Collection[str],
        before: int | None = None,
        limit: int = 100,
    ) -> list[Event]:
        """Events of one domain whose type is in ``types``, NEWEST first, at most ``limit``.

        Pass the smallest id seen as ``before`` for the next page. The fleet id keeps the
        scan on the fleet's events index.
        """
        return await _events.list_domain_events(
            self._ex, fleet_id, domain_id, types=types, before=before, limit=limit
        )
