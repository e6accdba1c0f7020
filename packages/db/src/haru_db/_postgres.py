"""PostgreSQL statement builders: one data-modifying CTE where a write spans two tables.

SQLite has no data-modifying CTEs; its half of each of these writes is a trigger created by
the migrations (named in each builder), fired by the same single statement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import OperationKind, SlotKind
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from haru_db._cleanup import PROMOTE_FAIL_CLEANUP
from haru_db._tables import UtcDateTime, events, fleets, operations, slots


def fail_with_cleanup(fail: sa.Update, *, at: datetime) -> sa.Select[Any]:
    """``fail`` plus :data:`~haru_db._cleanup.PROMOTE_FAIL_CLEANUP` on a promote's target.

    SQLite: ``trg_operations_promote_failed_cleanup``.
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
    # Every data-modifying CTE must be referenced for SQLAlchemy to render it.
    return sa.select(
        failed.c.id,
        sa.select(sa.func.count()).select_from(inference).scalar_subquery().label("inference"),
        sa.select(sa.func.count()).select_from(training).scalar_subquery().label("training"),
    )


def switch_active(
    *,
    fleet_id: UUID,
    pointer_matches: sa.ColumnElement[bool],
    running: sa.ColumnElement[bool],
    move: dict[str, Any],
    at: datetime,
) -> sa.Select[Any]:
    """Move the pointer and mark the (locked) operation ``routing_committed``.

    The operation row is locked (``FOR UPDATE``) so that, under READ COMMITTED, a concurrent
    ``fail_operation(target_not_routed=True)`` either commits first (the switch re-checks
    ``state = 'running'`` and loses) or waits and re-checks ``routing_committed = false``.
    SQLite: ``trg_fleets_switch_commits_routing``.
    """
    locked = sa.select(operations.c.id).where(running).with_for_update().cte("locked_op")
    moved = (
        sa.update(fleets)
        .where(fleets.c.id == fleet_id, pointer_matches, sa.exists(sa.select(locked.c.id)))
        .values(**move)
        .returning(fleets.c.id)
        .cte("moved")
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
    return sa.select(moved.c.id, sa.select(marked.c.id).scalar_subquery().label("op"))


def update_with_writes(
    update: sa.Update,
    documents: Sequence[dict[str, Any]],
    mirrors: Mapping[str, Any] | None,
    *,
    at: datetime,
) -> sa.Select[Any]:
    """An operation CAS that also moves its step's slots and appends ``documents`` (in order).

    All of it happens when, and only when, the CAS lands: the exit mirror first, then the
    events, then the entry mirror. ``mirrors`` is the ``{"exit", "entry"}`` document of
    :func:`haru_db._mirrors.mirror_documents` (or None). Each event gets the operation's
    fleet, target domain and id, and ``at``; the first one gets the exit mirror's count under
    its ``countInto`` key. SQLite: ``trg_operations_pending_writes``.
    """
    changed = update.returning(
        operations.c.id,
        operations.c.fleet_id,
        operations.c.target_domain_id,
        operations.c.source_domain_id,
    ).cte("changed_op")
    exit_doc = None if mirrors is None else mirrors.get("exit")
    entry_doc = None if mirrors is None else mirrors.get("entry")
    columns: list[Any] = [changed.c.id]
    moved_count: sa.ScalarSelect[Any] | None = None
    if exit_doc is not None:
        moved = _mirror_cte(changed, exit_doc, at=at, name="exit_mirror")
        moved_count = sa.select(sa.func.count()).select_from(moved).scalar_subquery()
        columns.append(moved_count.label("exit_moved"))
    if entry_doc is not None:
        entered = _mirror_cte(changed, entry_doc, at=at, name="entry_mirror")
        columns.append(
            sa.select(sa.func.count()).select_from(entered).scalar_subquery().label("entry_moved")
        )
    if documents:
        count_into = None if exit_doc is None else exit_doc.get("countInto")
        rows = []
        for index, doc in enumerate(documents):
            payload: sa.ColumnElement[Any] = sa.literal(doc["payload"], JSONB())
            if index == 0 and count_into is not None and moved_count is not None:
                payload = sa.func.jsonb_set(
                    payload,
                    sa.literal([str(count_into)], ARRAY(sa.Text())),
                    sa.func.to_jsonb(moved_count),
                )
            rows.append(
                sa.select(
                    changed.c.fleet_id.label("fleet_id"),
                    changed.c.target_domain_id.label("domain_id"),
                    changed.c.id.label("operation_id"),
                    sa.literal(doc["type"], events.c.type.type).label("type"),
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
                    sa.literal(at, UtcDateTime()),
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


def _mirror_cte(changed: sa.CTE, doc: Mapping[str, Any], *, at: datetime, name: str) -> sa.CTE:
    domain = changed.c.source_domain_id if doc["onSource"] else changed.c.target_domain_id
    return (
        sa.update(slots)
        .where(
            slots.c.domain_id == sa.select(domain).scalar_subquery(),
            slots.c.kind == str(doc["kind"]),
            slots.c.state.in_([str(s) for s in doc["from"]]),
        )
        .values(state=str(doc["to"]), state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
        .cte(name)
    )
