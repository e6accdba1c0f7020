"""PostgreSQL statement builders: one data-modifying CTE where a write spans two tables.

SQLite has no data-modifying CTEs; its half of each of these writes is a trigger created by
the migrations (named in each builder), fired by the same single statement.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import OperationKind, OperationState, SlotKind
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from haru_db._cleanup import PROMOTE_FAIL_CLEANUP
from haru_db._tables import UtcDateTime, events, fleets, operations, slots


def fail_with_cleanup(
    fail: sa.Update, *, at: datetime, documents: Sequence[Mapping[str, Any]] = ()
) -> sa.Select[Any]:
    """``fail`` plus :data:`~haru_db._cleanup.PROMOTE_FAIL_CLEANUP` on a promote's target.

    ``documents`` (``{"type", "payload"}``) are appended in order, about the operation, only
    when it failed. SQLite: ``trg_operations_promote_failed_cleanup`` and
    ``trg_operations_pending_writes``.
    """
    rule = PROMOTE_FAIL_CLEANUP
    failed = fail.returning(
        operations.c.id,
        operations.c.kind,
        operations.c.fleet_id,
        operations.c.target_domain_id,
    ).cte("failed_op")
    on_target = sa.and_(
        failed.c.kind == OperationKind.PROMOTE.value,
        slots.c.domain_id == failed.c.target_domain_id,
    )
    pointer_at_target = sa.exists(
        sa.select(fleets.c.id).where(
            fleets.c.id == failed.c.fleet_id,
            fleets.c.active_domain_id == failed.c.target_domain_id,
        )
    )
    inference = (
        sa.update(slots)
        .where(
            on_target,
            slots.c.kind == SlotKind.INFERENCE.value,
            sa.or_(
                slots.c.state.in_(rule.inference_failed_from),
                sa.and_(slots.c.state.in_(rule.inference_failed_unless_routed), ~pointer_at_target),
            ),
        )
        .values(state=rule.inference_to, state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
        .cte("failed_inference_slots")
    )
    training = (
        sa.update(slots)
        .where(
            on_target,
            slots.c.kind == SlotKind.TRAINING.value,
            slots.c.state.in_(rule.training_resumed_from),
        )
        .values(state=rule.training_to, state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
        .cte("resumed_training_slots")
    )
    bumped = bump_fence(failed)
    # Every data-modifying CTE must be referenced for SQLAlchemy to render it. The fence comes
    # first: the fleet's row is then locked before the slots', as in the operation CAS.
    columns: list[Any] = [
        failed.c.id,
        sa.select(bumped.c.fence).scalar_subquery().label("fence"),
        sa.select(sa.func.count()).select_from(inference).scalar_subquery().label("inference"),
        sa.select(sa.func.count()).select_from(training).scalar_subquery().label("training"),
    ]
    if documents:
        appended = appended_over(failed, documents, sa.literal(at, UtcDateTime()))
        columns.append(
            sa.select(sa.func.count()).select_from(appended).scalar_subquery().label("events")
        )
    return sa.select(*columns)


def bump_fence(changed: sa.CTE) -> sa.CTE:
    """Raise the fence of the fleet of the operation ``changed`` wrote (none: no bump).

    ``changed`` must return ``fleet_id``. The fleet's row is locked after the operation's (as
    :func:`switch_active` does), and ``fence + 1`` is re-evaluated on the newest row version
    when a concurrent write got there first, so no two writes get the same token. SQLite:
    ``trg_operations_fence_cas`` and ``trg_operations_fence_create``.
    """
    return (
        sa.update(fleets)
        .where(fleets.c.id.in_(sa.select(changed.c.fleet_id)))
        .values(fence=fleets.c.fence + 1)
        .returning(fleets.c.fence)
        .cte("bumped_fence")
    )


def create_operation(insert: sa.Insert, documents: Sequence[Mapping[str, Any]]) -> sa.Select[Any]:
    """``insert`` (one operation, ``ON CONFLICT DO NOTHING``), its fence bump and its events.

    ``documents`` (``{"type", "payload"}``) are appended in order, with the inserted row's
    fleet, target domain, id and creation time, only when the row is inserted. Returns the
    inserted row (none when nothing was inserted) with the new ``fence``. SQLite:
    ``trg_operations_fence_create`` and ``trg_operations_insert_events``.
    """
    inserted = insert.returning(*operations.c).cte("inserted_op")
    bumped = bump_fence(inserted)
    columns: list[Any] = [
        *(inserted.c[column.name] for column in operations.c),
        sa.select(bumped.c.fence).scalar_subquery().label("fence"),
    ]
    if documents:
        appended = appended_over(inserted, documents, inserted.c.created_at)
        # Every data-modifying CTE must be referenced for SQLAlchemy to render it.
        columns.append(
            sa.select(sa.func.count()).select_from(appended).scalar_subquery().label("events")
        )
    return sa.select(*columns)


def appended_over(
    written: sa.CTE, documents: Sequence[Mapping[str, Any]], created_at: Any
) -> sa.CTE:
    """Append ``documents`` (in order) over the operation row ``written`` returned, if any.

    Each event gets the row's fleet, target domain and id, and ``created_at``. ``written``
    must return ``fleet_id``, ``target_domain_id`` and ``id``.
    """
    rows = [
        sa.select(
            sa.literal(document["type"], events.c.type.type).label("type"),
            sa.cast(sa.literal(document["payload"], JSONB()), sa.JSON()).label("payload"),
            sa.literal(index, sa.Integer()).label("ord"),
        )
        for index, document in enumerate(documents)
    ]
    source = sa.union_all(*rows).subquery("new_events")
    return (
        sa.insert(events)
        .from_select(
            ["fleet_id", "domain_id", "operation_id", "type", "payload", "created_at"],
            sa.select(
                written.c.fleet_id,
                written.c.target_domain_id,
                written.c.id,
                source.c.type,
                source.c.payload,
                created_at,
            )
            .select_from(written)
            .join(source, sa.true())
            .order_by(source.c.ord),
        )
        .returning(events.c.id)
        .cte("appended")
    )


def switch_active(
    *,
    fleet_id: UUID,
    expected_active_domain_id: UUID | None,
    target_domain_id: UUID,
    operation_id: UUID,
    at: datetime,
    event: Mapping[str, Any],
) -> tuple[sa.Select[Any], dict[str, Any]]:
    """Move the pointer, mark the (locked) operation ``routing_committed``, append ``event``.

    ``event`` is the ``{"type", "payload"}`` document of the switch's ``routing.switched``:
    appended only when the pointer moved, about the operation and the target, with the
    revision the switch wrote as the payload's ``routeRevision``.

    The operation row is locked (``FOR UPDATE``) so that, under READ COMMITTED, a concurrent
    ``fail_operation(target_not_routed=True)`` either commits first (the switch re-checks
    ``state = 'running'`` and loses) or waits and re-checks ``routing_committed = false``.
    Built once per shape (whether a domain is expected active) and reused with new
    parameters. SQLite: ``trg_fleets_switch_commits_routing`` and ``trg_fleets_config_events``.
    Returns the statement and its parameters.
    """
    params: dict[str, Any] = {
        "p_fleet_id": fleet_id,
        "p_target": target_domain_id,
        "p_op_id": operation_id,
        "p_at": at,
        "p_event_type": event["type"],
        "p_event_payload": event["payload"],
    }
    if expected_active_domain_id is not None:
        params["p_expected"] = expected_active_domain_id
    return _switch_active_statement(expected_active_domain_id is None), params


@functools.lru_cache(maxsize=2)
def _switch_active_statement(expect_none: bool) -> sa.Select[Any]:
    at = sa.bindparam("p_at", type_=UtcDateTime())
    fleet_id = sa.bindparam("p_fleet_id", type_=fleets.c.id.type)
    operation_id = sa.bindparam("p_op_id", type_=operations.c.id.type)
    target = sa.bindparam("p_target", type_=fleets.c.active_domain_id.type)
    pointer_matches = (
        fleets.c.active_domain_id.is_(None)
        if expect_none
        else fleets.c.active_domain_id
        == sa.bindparam("p_expected", type_=fleets.c.active_domain_id.type)
    )
    running = sa.and_(
        operations.c.id == operation_id,
        operations.c.fleet_id == fleet_id,
        operations.c.state == OperationState.RUNNING.value,
    )
    locked = sa.select(operations.c.id).where(running).with_for_update().cte("locked_op")
    moved = (
        sa.update(fleets)
        .where(fleets.c.id == fleet_id, pointer_matches, sa.exists(sa.select(locked.c.id)))
        .values(
            active_domain_id=target,
            route_revision=fleets.c.route_revision + 1,
            last_switch_operation_id=operation_id,
            updated_at=at,
        )
        .returning(fleets.c.id, fleets.c.route_revision)
        .cte("moved")
    )
    payload = sa.bindparam("p_event_payload", type_=JSONB()).op("||")(
        sa.func.jsonb_build_object(sa.literal_column("'routeRevision'"), moved.c.route_revision)
    )
    appended = (
        sa.insert(events)
        .from_select(
            ["fleet_id", "domain_id", "operation_id", "type", "payload", "created_at"],
            sa.select(
                moved.c.id,
                target,
                operation_id,
                sa.bindparam("p_event_type", type_=events.c.type.type),
                sa.cast(payload, sa.JSON()),
                at,
            ),
        )
        .returning(events.c.id)
        .cte("appended")
    )
    marked = (
        sa.update(operations)
        .where(
            operations.c.id.in_(sa.select(locked.c.id)),
            sa.exists(sa.select(moved.c.id)),
        )
        .values(routing_committed=True, updated_at=at)
        .returning(operations.c.id)
        .cte("marked")
    )
    return sa.select(
        moved.c.id,
        sa.select(marked.c.id).scalar_subquery().label("op"),
        sa.select(appended.c.id).scalar_subquery().label("event"),
    )


CasKind = Literal["claim", "advance", "complete"]
"""Which operation CAS :func:`operation_cas` wraps."""


def operation_cas(
    kind: CasKind,
    *,
    operation_id: UUID,
    from_step: str | None,
    to_step: str | None,
    at: datetime,
    documents: Sequence[dict[str, Any]],
    mirrors: Mapping[str, Any] | None,
) -> tuple[sa.Select[Any], dict[str, Any]]:
    """An operation CAS that also moves its step's slots and appends ``documents`` (in order).

    All of it happens when, and only when, the CAS lands: the fleet's fence grows by one
    (returned as ``fence``), the exit mirror is applied first, then the events, then the entry
    mirror. ``mirrors`` is the ``{"exit", "entry"}`` document of
    :func:`haru_db._mirrors.mirror_documents` (or None). Each event gets the operation's
    fleet, target domain and id, and ``at``; the first one gets the exit mirror's count under
    its ``countInto`` key. SQLite: ``trg_operations_pending_writes``.

    The statement depends only on its shape (the CAS, how many events, which mirrors), so it
    is built once per shape with bind parameters and reused: building this CTE costs more
    Python than running it (about 2.6 ms against 0.9 ms of server time, on a 2-vCPU
    machine). Returns the statement and its parameters.
    """
    exit_doc = None if mirrors is None else mirrors.get("exit")
    entry_doc = None if mirrors is None else mirrors.get("entry")
    count_into = None if exit_doc is None else exit_doc.get("countInto")
    stmt = _operation_cas_statement(
        kind,
        len(documents),
        None if exit_doc is None else (bool(exit_doc["onSource"]), count_into is not None),
        None if entry_doc is None else bool(entry_doc["onSource"]),
    )
    params = cas_params(operation_id=operation_id, from_step=from_step, to_step=to_step, at=at)
    for prefix, doc in (("p_exit", exit_doc), ("p_entry", entry_doc)):
        if doc is not None:
            params[f"{prefix}_kind"] = str(doc["kind"])
            params[f"{prefix}_from"] = [str(state) for state in doc["from"]]
            params[f"{prefix}_to"] = str(doc["to"])
    if count_into is not None:
        params["p_count_into"] = [str(count_into)]
    for index, doc in enumerate(documents):
        params[f"p_type_{index}"] = doc["type"]
        params[f"p_payload_{index}"] = doc["payload"]
    return stmt, params


def cas_params(
    *, operation_id: UUID, from_step: str | None, to_step: str | None, at: datetime
) -> dict[str, Any]:
    """The parameters of :func:`cas_update`."""
    params: dict[str, Any] = {"p_op_id": operation_id, "p_at": at}
    if from_step is not None:
        params["p_from_step"] = from_step
    if to_step is not None:
        params["p_to_step"] = to_step
    return params


def cas_update(kind: CasKind) -> sa.Update:
    """The operation CAS of ``kind`` on both engines (values: :func:`cas_params`).

    It changes ``state`` or ``current_step``, which on SQLite fires
    ``trg_operations_fence_cas`` (the fleet's fence bump) before the row changes.
    """
    op = operations.c
    at = sa.bindparam("p_at", type_=UtcDateTime())
    step: Any = op.current_step.type
    this = op.id == sa.bindparam("p_op_id", type_=op.id.type)
    if kind == "claim":
        return (
            sa.update(operations)
            .where(this, op.state == OperationState.PENDING.value)
            .values(
                state=OperationState.RUNNING.value,
                current_step=sa.bindparam("p_to_step", type_=step),
                step_started_at=at,
                updated_at=at,
            )
        )
    at_step = sa.and_(
        this,
        op.state == OperationState.RUNNING.value,
        op.current_step == sa.bindparam("p_from_step", type_=step),
    )
    if kind == "advance":
        return (
            sa.update(operations)
            .where(at_step)
            .values(
                current_step=sa.bindparam("p_to_step", type_=step),
                step_started_at=at,
                updated_at=at,
            )
        )
    return (
        sa.update(operations)
        .where(at_step)
        .values(state=OperationState.SUCCEEDED.value, finished_at=at, updated_at=at)
    )


@functools.lru_cache(maxsize=128)
def _operation_cas_statement(
    kind: CasKind,
    event_count: int,
    exit_shape: tuple[bool, bool] | None,
    entry_on_source: bool | None,
) -> sa.Select[Any]:
    """The statement of :func:`operation_cas` for one shape.

    ``exit_shape`` is the exit mirror's ``(onSource, counted)``, ``entry_on_source`` the entry
    mirror's ``onSource`` (None: no such mirror).
    """
    changed = (
        cas_update(kind)
        .returning(
            operations.c.id,
            operations.c.fleet_id,
            operations.c.target_domain_id,
            operations.c.source_domain_id,
        )
        .cte("changed_op")
    )
    at = sa.bindparam("p_at", type_=UtcDateTime())
    bumped = bump_fence(changed)
    columns: list[Any] = [changed.c.id, sa.select(bumped.c.fence).scalar_subquery().label("fence")]
    moved_count: sa.ScalarSelect[Any] | None = None
    if exit_shape is not None:
        moved = _mirror_cte(changed, "p_exit", on_source=exit_shape[0], name="exit_mirror")
        moved_count = sa.select(sa.func.count()).select_from(moved).scalar_subquery()
        columns.append(moved_count.label("exit_moved"))
    if entry_on_source is not None:
        entered = _mirror_cte(changed, "p_entry", on_source=entry_on_source, name="entry_mirror")
        columns.append(
            sa.select(sa.func.count()).select_from(entered).scalar_subquery().label("entry_moved")
        )
    if event_count:
        counted = moved_count if exit_shape is not None and exit_shape[1] else None
        rows = []
        for index in range(event_count):
            payload: sa.ColumnElement[Any] = sa.bindparam(f"p_payload_{index}", type_=JSONB())
            if index == 0 and counted is not None:
                payload = sa.func.jsonb_set(
                    payload,
                    sa.bindparam("p_count_into", type_=ARRAY(sa.Text())),
                    sa.func.to_jsonb(counted),
                )
            rows.append(
                sa.select(
                    changed.c.fleet_id.label("fleet_id"),
                    changed.c.target_domain_id.label("domain_id"),
                    changed.c.id.label("operation_id"),
                    sa.bindparam(f"p_type_{index}", type_=events.c.type.type).label("type"),
                    sa.cast(payload, sa.JSON()).label("payload"),
                    sa.literal(index, sa.Integer()).label("ord"),
                )
            )
        source = sa.union_all(*rows).subquery("new_events")
        appended = (
            sa.insert(events)
            .from_select(
                ["fleet_id", "domain_id", "operation_id", "type", "payload", "created_at"],
                sa.select(
                    source.c.fleet_id,
                    source.c.domain_id,
                    source.c.operation_id,
                    source.c.type,
                    source.c.payload,
                    at,
                ).order_by(source.c.ord),
            )
            .returning(events.c.id)
            .cte("appended")
        )
        columns.append(
            sa.select(sa.func.count()).select_from(appended).scalar_subquery().label("events")
        )
    # Every data-modifying CTE must be referenced for SQLAlchemy to render it.
    return sa.select(*columns)


def _mirror_cte(changed: sa.CTE, prefix: str, *, on_source: bool, name: str) -> sa.CTE:
    domain = changed.c.source_domain_id if on_source else changed.c.target_domain_id
    at = sa.bindparam("p_at", type_=UtcDateTime())
    return (
        sa.update(slots)
        .where(
            slots.c.domain_id == sa.select(domain).scalar_subquery(),
            slots.c.kind == sa.bindparam(f"{prefix}_kind", type_=slots.c.kind.type),
            slots.c.state.in_(
                sa.bindparam(f"{prefix}_from", type_=slots.c.state.type, expanding=True)
            ),
        )
        .values(
            state=sa.bindparam(f"{prefix}_to", type_=slots.c.state.type),
            state_updated_at=at,
            updated_at=at,
        )
        .returning(slots.c.id)
        .cte(name)
    )
