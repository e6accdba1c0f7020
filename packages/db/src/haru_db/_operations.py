"""The operation lifecycle: create (or join), claim, advance, complete, fail, switch_active.

Each write is one statement. Two writes touch another table in that same statement:
``fail_operation`` on a promote applies :data:`~haru_db._cleanup.PROMOTE_FAIL_CLEANUP` to its
target's slots, and ``switch_active`` moves the pointer and marks its operation
``routing_committed``; create appends its events only when it inserts; claim, advance and
complete may append events (an :class:`~haru_db._events.OperationEvent` list) and move their
step's slot states (a :class:`~haru_db._mirrors.SlotMirror` on exit and on entry) only when
their CAS lands.
PostgreSQL runs these as data-modifying CTEs (:mod:`haru_db._postgres`); SQLite fires triggers
created by the migrations, and a writing statement takes SQLite's write lock as it starts,
which serialises its writers. Every one of these writes also raises its fleet's fencing token
(``fleets.fence``, migration 0007) in that same statement; claim and advance return it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import sqlalchemy as sa
from haru_protocol import (
    EventPayload,
    Operation,
    OperationError,
    OperationKind,
    OperationState,
    OperationStep,
    RoutingSwitched,
)

from haru_db import _postgres
from haru_db._cleanup import PROMOTE_FAIL_CLEANUP
from haru_db._errors import DomainRemovedError, HaruDbError
from haru_db._events import OperationEvent, typed_event
from haru_db._exec import Executor, aware
from haru_db._mirrors import SlotMirror, mirror_documents
from haru_db._rows import operation_from_row
from haru_db._tables import IN_FLIGHT_STATES, domains, fleets, operations

CREATE_OPERATION_ATTEMPTS = 5

_RUNNING = OperationState.RUNNING.value
_PENDING = OperationState.PENDING.value


async def create_operation(
    ex: Executor,
    *,
    fleet_id: UUID,
    kind: OperationKind,
    target_domain_id: UUID,
    at: datetime,
    events: Callable[[Operation], Sequence[EventPayload]] | None = None,
) -> tuple[Operation, bool]:
    at = aware(at)
    for _ in range(CREATE_OPERATION_ATTEMPTS):
        # The source is the pointer read here; the insert is skipped (and tried again) when
        # the pointer has moved since, so the events are built from the row it will write.
        pointer = await ex.read(sa.select(fleets.c.active_domain_id).where(fleets.c.id == fleet_id))
        row: dict[str, Any] = {
            "id": uuid4(),
            "fleet_id": fleet_id,
            "kind": str(kind),
            "state": _PENDING,
            "target_domain_id": target_domain_id,
            "source_domain_id": pointer[0]["active_domain_id"] if pointer else None,
            "current_step": None,
            "step_started_at": None,
            "error": None,
            "routing_committed": False,
            "created_at": at,
            "updated_at": at,
            "finished_at": None,
        }
        documents = (
            []
            if events is None
            else [_event_document(payload) for payload in events(operation_from_row(row))]
        )
        rows = await ex.write(_insert_operation(ex, row, documents))
        if rows:
            return operation_from_row(rows[0]), True
        existing = await get_in_flight_operation(ex, fleet_id)
        if existing is not None:
            return existing, False
        # trg_operations_target_not_removed skips the insert of an operation on a removed
        # domain (migration 0012; on PostgreSQL after the removal it waited for commits).
        removed = await ex.read(
            sa.select(domains.c.id).where(
                domains.c.id == target_domain_id, domains.c.removed_at.is_not(None)
            )
        )
        if removed:
            raise DomainRemovedError(target_domain_id)
        # The in-flight operation finished, or the pointer moved, between the statements.
    raise HaruDbError(
        f"could not create an operation for fleet {fleet_id}: in-flight operations kept "
        f"finishing in between ({CREATE_OPERATION_ATTEMPTS} attempts)"
    )


def _event_document(payload: EventPayload) -> dict[str, Any]:
    type_, document = typed_event(None, payload)
    return {"type": type_, "payload": document}


def _insert_operation(
    ex: Executor, row: Mapping[str, Any], documents: Sequence[dict[str, Any]]
) -> sa.Insert | sa.Select[Any]:
    """The one statement that inserts ``row`` and appends ``documents`` with it.

    Nothing is written on a conflict with the fleet's in-flight operation (the id is fresh, so
    only the one-in-flight index can conflict) or when the fleet's pointer is no longer the
    row's source; an unknown fleet still reaches the insert, whose foreign key refuses it.
    With the insert, in the same statement, the fleet's fence grows by one and ``documents``
    become events of the operation (its fleet, target domain, id and creation time): on
    PostgreSQL by data-modifying CTEs (:func:`haru_db._postgres.create_operation`), on SQLite
    by ``trg_operations_fence_create`` and ``trg_operations_insert_events`` (which appends
    ``pending_events`` and clears it).
    """
    # A NULL is left to the column's default: an untyped NULL in a SELECT list is text.
    columns = [c.name for c in operations.c if row.get(c.name) is not None]
    values: dict[str, Any] = dict(row)
    if documents and ex.dialect != "postgresql":
        columns.append("pending_events")
        values["pending_events"] = documents
    moved = sa.exists(
        sa.select(fleets.c.id).where(
            fleets.c.id == row["fleet_id"],
            fleets.c.active_domain_id.is_distinct_from(row["source_domain_id"]),
        )
    )
    select = sa.select(
        *(sa.literal(values[name], operations.c[name].type).label(name) for name in columns)
    ).where(~moved)
    insert = ex.insert(operations).from_select(columns, select).on_conflict_do_nothing()
    if ex.dialect == "postgresql":
        return _postgres.create_operation(insert, documents)
    return insert.returning(*operations.c)


async def get_in_flight_operation(ex: Executor, fleet_id: UUID) -> Operation | None:
    stmt = sa.select(operations).where(
        operations.c.fleet_id == fleet_id, operations.c.state.in_(IN_FLIGHT_STATES)
    )
    rows = await ex.read(stmt)
    return operation_from_row(rows[0]) if rows else None


async def get_operation_fence(ex: Executor, operation_id: UUID, step: OperationStep) -> int | None:
    """The fence of ``operation_id`` while it runs ``step``; None once it is anywhere else.

    One statement reads both rows, so the token always belongs to that step: while an
    operation is in flight only its own writes move its fleet's fence.
    """
    stmt = (
        sa.select(fleets.c.fence)
        .join(operations, operations.c.fleet_id == fleets.c.id)
        .where(
            operations.c.id == operation_id,
            operations.c.state == _RUNNING,
            operations.c.current_step == str(step),
        )
    )
    rows = await ex.read(stmt)
    return int(rows[0]["fence"]) if rows else None


async def list_recent_operations(ex: Executor, fleet_id: UUID, *, limit: int) -> list[Operation]:
    stmt = (
        sa.select(operations)
        .where(operations.c.fleet_id == fleet_id)
        .order_by(operations.c.created_at.desc())
        .limit(limit)
    )
    return [operation_from_row(row) for row in await ex.read(stmt)]


async def _cas(
    ex: Executor,
    kind: _postgres.CasKind,
    events: Sequence[OperationEvent],
    *,
    operation_id: UUID,
    from_step: OperationStep | None,
    to_step: OperationStep | None,
    at: datetime,
    exit_mirror: SlotMirror | None = None,
    entry_mirror: SlotMirror | None = None,
) -> int | None:
    """Run an operation CAS, with its slot mirrors and events in the same statement.

    Only when the CAS lands: the fleet's fence grows by one, ``exit_mirror`` is applied,
    ``events`` appended and ``entry_mirror`` applied, in that order. The CAS is
    :func:`haru_db._postgres.cas_update` on both engines; PostgreSQL wraps it in a statement
    built once per shape (:func:`haru_db._postgres.operation_cas`).

    Returns:
        The fleet's new fence (the token of the step the CAS started), or None when the CAS
        did not land.
    """
    at = aware(at)
    froms = None if from_step is None else str(from_step)
    tos = None if to_step is None else str(to_step)
    mirrors = mirror_documents(exit_mirror, entry_mirror)
    documents = [event.document() for event in events]
    if ex.dialect == "postgresql":
        stmt, params = _postgres.operation_cas(
            kind,
            operation_id=operation_id,
            from_step=froms,
            to_step=tos,
            at=at,
            documents=documents,
            mirrors=mirrors,
        )
        return _fence(await ex.write(stmt, params))
    params = _postgres.cas_params(operation_id=operation_id, from_step=froms, to_step=tos, at=at)
    # On SQLite trg_operations_pending_writes applies these (and clears both columns).
    values: dict[str, Any] = {}
    if documents:
        values["pending_events"] = documents
    if mirrors is not None:
        values["pending_mirrors"] = mirrors
    # trg_operations_fence_cas bumps the fence before the row changes, so RETURNING sees it.
    update = _postgres.cas_update(kind).values(**values).returning(_FLEET_FENCE)
    return _fence(await ex.write(update, params))


_FLEET_FENCE = (
    sa.select(fleets.c.fence)
    .where(fleets.c.id == operations.c.fleet_id)
    .scalar_subquery()
    .label("fence")
)


def _fence(rows: Sequence[Any]) -> int | None:
    return int(rows[0]["fence"]) if rows else None


async def claim_operation(
    ex: Executor,
    operation_id: UUID,
    *,
    first_step: OperationStep,
    at: datetime,
    events: Sequence[OperationEvent],
    entry_mirror: SlotMirror | None = None,
) -> int | None:
    return await _cas(
        ex,
        "claim",
        events,
        operation_id=operation_id,
        from_step=None,
        to_step=first_step,
        at=at,
        entry_mirror=entry_mirror,
    )


async def advance_step(
    ex: Executor,
    operation_id: UUID,
    *,
    from_step: OperationStep,
    to_step: OperationStep,
    at: datetime,
    events: Sequence[OperationEvent],
    exit_mirror: SlotMirror | None = None,
    entry_mirror: SlotMirror | None = None,
) -> int | None:
    return await _cas(
        ex,
        "advance",
        events,
        operation_id=operation_id,
        from_step=from_step,
        to_step=to_step,
        at=at,
        exit_mirror=exit_mirror,
        entry_mirror=entry_mirror,
    )


async def complete_operation(
    ex: Executor,
    operation_id: UUID,
    *,
    from_step: OperationStep,
    at: datetime,
    events: Sequence[OperationEvent],
    exit_mirror: SlotMirror | None = None,
) -> bool:
    return bool(
        await _cas(
            ex,
            "complete",
            events,
            operation_id=operation_id,
            from_step=from_step,
            to_step=None,
            at=at,
            exit_mirror=exit_mirror,
        )
    )


async def fail_operation(
    ex: Executor,
    operation_id: UUID,
    *,
    error: OperationError,
    at: datetime,
    expected_step: OperationStep | None,
    target_not_routed: bool,
    events: Sequence[OperationEvent] = (),
) -> bool:
    PROMOTE_FAIL_CLEANUP.check()
    at = aware(at)
    documents = [event.document() for event in events]
    conditions: list[sa.ColumnElement[bool]] = [
        operations.c.id == operation_id,
        operations.c.state.in_(IN_FLIGHT_STATES),
    ]
    if expected_step is not None:
        conditions.append(operations.c.current_step == str(expected_step))
    if target_not_routed:
        conditions.append(operations.c.routing_committed.is_(sa.false()))
    fail = (
        sa.update(operations)
        .where(*conditions)
        .values(
            state=OperationState.FAILED.value,
            error=error.model_dump(mode="json"),
            finished_at=at,
            updated_at=at,
        )
    )
    if ex.dialect == "sqlite":
        # trg_operations_promote_failed_cleanup does the slots' half in this statement,
        # trg_operations_fence_cas the fence bump and trg_operations_pending_writes the events.
        if documents:
            fail = fail.values(pending_events=documents)
        return bool(await ex.write(fail.returning(operations.c.id)))
    return bool(await ex.write(_postgres.fail_with_cleanup(fail, at=at, documents=documents)))


async def switch_active(
    ex: Executor,
    *,
    fleet_id: UUID,
    expected_active_domain_id: UUID | None,
    target_domain_id: UUID,
    operation_id: UUID,
    at: datetime,
) -> bool:
    at = aware(at)
    # routing.switched rides the switch, with the revision the switch wrote.
    switched = OperationEvent.of(
        RoutingSwitched(
            from_domain_id=expected_active_domain_id,
            to_domain_id=target_domain_id,
            route_revision=None,
        )
    ).document()
    if ex.dialect == "postgresql":
        stmt_pg, params = _postgres.switch_active(
            fleet_id=fleet_id,
            expected_active_domain_id=expected_active_domain_id,
            target_domain_id=target_domain_id,
            operation_id=operation_id,
            at=at,
            event=switched,
        )
        return bool(await ex.write(stmt_pg, params))
    pointer_matches = (
        fleets.c.active_domain_id.is_(None)
        if expected_active_domain_id is None
        else fleets.c.active_domain_id == expected_active_domain_id
    )
    running = sa.and_(
        operations.c.id == operation_id,
        operations.c.fleet_id == fleet_id,
        operations.c.state == _RUNNING,
    )
    move: dict[str, Any] = {
        "active_domain_id": target_domain_id,
        "route_revision": fleets.c.route_revision + 1,
        "last_switch_operation_id": operation_id,
        "updated_at": at,
        # trg_fleets_config_events (migration 0013) appends it, about the operation and the
        # target, with the row's new route_revision under revisionInto.
        "pending_events": [
            {
                **switched,
                "operationId": operation_id.hex,
                "domainId": target_domain_id.hex,
                "revisionInto": "routeRevision",
            }
        ],
    }
    # trg_fleets_switch_commits_routing marks the operation in this statement.
    stmt = (
        sa.update(fleets)
        .where(
            fleets.c.id == fleet_id,
            pointer_matches,
            sa.exists(sa.select(operations.c.id).where(running)),
        )
        .values(**move)
        .returning(fleets.c.id)
    )
    return bool(await ex.write(stmt))
