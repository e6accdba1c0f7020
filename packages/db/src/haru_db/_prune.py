"""Retention: deleting finished operations and old events in bounded batches.

The rule (one source, used by the delete statements and the dry-run count alike):

- an operation goes when it is finished, finished before the cutoff, and is not among the
  newest :data:`KEEP_RECENT_OPERATIONS` of its fleet (by ``created_at``, ties kept), so
  :meth:`~haru_db.StateStore.list_recent_operations` (promotion and restore backoff) reads
  exactly what it read before any pruning; an in-flight operation never goes;
- an operation's events go with it (whatever their age) and stay with it; an event of no
  operation goes when it was created before the cutoff;
- except the events a relaunch streak is read from (``domain.relaunch``,
  ``domain.state.changed``, ``domain.up.requested``) of a domain that is not ``ready``: the
  server counts a failed domain's relaunches from them, so pruning them would restart a spent
  streak.

Each batch is ONE statement (``DELETE ... WHERE id IN (SELECT ... ORDER BY ... LIMIT n)``) on
both engines. Events go first (oldest id first), then the operations no event refers to any
more (``events.operation_id`` references ``operations.id``), so no statement ever breaks that
key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from haru_protocol import DomainState, EventType

from haru_db._exec import Executor, aware
from haru_db._tables import FINISHED_STATES, domains, events, operations

KEEP_RECENT_OPERATIONS = 64
"""Operations kept per fleet whatever their age: the most the server reads back (backoff)."""

DEFAULT_PRUNE_BATCH = 1000
"""Rows one delete statement removes at most."""

RELAUNCH_STREAK_EVENTS: frozenset[str] = frozenset(
    {
        EventType.DOMAIN_RELAUNCH.value,
        EventType.DOMAIN_STATE_CHANGED.value,
        EventType.DOMAIN_UP_REQUESTED.value,
    }
)
"""Event types a failed domain's relaunch streak is counted from (kept while it is not ready)."""


@dataclass(frozen=True, slots=True)
class PruneCounts:
    """Rows a prune deleted (or, for a dry run, would delete)."""

    events: int
    operations: int

    def __add__(self, other: PruneCounts) -> PruneCounts:
        return PruneCounts(self.events + other.events, self.operations + other.operations)


def _doomed_operations(before: datetime, keep_recent: int) -> sa.Select[tuple[object]]:
    """Ids of the operations the rule deletes (their events aside)."""
    ranked = sa.select(
        operations.c.id,
        operations.c.state,
        operations.c.finished_at,
        # rank(), not row_number(): operations tied with the Nth newest are all kept, since
        # LIMIT may return any of them.
        sa.func.rank()
        .over(partition_by=operations.c.fleet_id, order_by=operations.c.created_at.desc())
        .label("recency"),
    ).subquery("ranked")
    return sa.select(ranked.c.id).where(
        ranked.c.state.in_(FINISHED_STATES),
        ranked.c.finished_at < before,
        ranked.c.recency > keep_recent,
    )


def _doomed_events_where(
    e: sa.FromClause, before: datetime, keep_recent: int
) -> sa.ColumnElement[bool]:
    not_ready = sa.select(domains.c.id).where(domains.c.state != DomainState.READY.value)
    streak = sa.and_(
        e.c.type.in_(sorted(RELAUNCH_STREAK_EVENTS)),
        e.c.domain_id.in_(not_ready),
    )
    return sa.and_(
        sa.or_(
            sa.and_(e.c.operation_id.is_(None), e.c.created_at < before),
            e.c.operation_id.in_(_doomed_operations(before, keep_recent)),
        ),
        sa.not_(streak),
    )


def _check(before: datetime, keep_recent: int) -> datetime:
    if keep_recent < 0:
        raise ValueError(f"keep_recent must be >= 0, got {keep_recent}")
    return aware(before)


async def delete_events_batch(
    ex: Executor, *, before: datetime, keep_recent: int, batch: int
) -> int:
    """Delete up to ``batch`` prunable events, oldest first; how many went."""
    before = _check(before, keep_recent)
    e = events.alias("e")
    chosen = (
        sa.select(e.c.id)
        .where(_doomed_events_where(e, before, keep_recent))
        .order_by(e.c.id)
        .limit(batch)
    )
    stmt = sa.delete(events).where(events.c.id.in_(chosen)).returning(events.c.id)
    return len(await ex.write(stmt))


def _referenced(ev: sa.FromClause) -> sa.Select[tuple[object]]:
    return sa.select(ev.c.operation_id).where(ev.c.operation_id.is_not(None))


async def delete_operations_batch(
    ex: Executor, *, before: datetime, keep_recent: int, batch: int
) -> int:
    """Delete up to ``batch`` prunable operations no event refers to; how many went."""
    before = _check(before, keep_recent)
    doomed = _doomed_operations(before, keep_recent).subquery("doomed")
    chosen = (
        sa.select(doomed.c.id)
        # Uncorrelated: one pass over events (events.operation_id has no index).
        .where(doomed.c.id.not_in(_referenced(events.alias("ev"))))
        .order_by(doomed.c.id)
        .limit(batch)
    )
    stmt = sa.delete(operations).where(operations.c.id.in_(chosen)).returning(operations.c.id)
    return len(await ex.write(stmt))


async def count_prunable(ex: Executor, *, before: datetime, keep_recent: int) -> PruneCounts:
    """What a full prune at ``before`` would delete now (one read)."""
    before = _check(before, keep_recent)
    e = events.alias("e")
    n_events = (
        sa.select(sa.func.count())
        .select_from(e)
        .where(_doomed_events_where(e, before, keep_recent))
    )
    ev = events.alias("ev")
    kept_refs = _referenced(ev).where(sa.not_(_doomed_events_where(ev, before, keep_recent)))
    doomed = _doomed_operations(before, keep_recent).subquery("doomed")
    n_operations = (
        sa.select(sa.func.count()).select_from(doomed).where(doomed.c.id.not_in(kept_refs))
    )
    stmt = sa.select(
        n_events.scalar_subquery().label("events"),
        n_operations.scalar_subquery().label("operations"),
    )
    row = (await ex.read(stmt))[0]
    return PruneCounts(events=int(row["events"]), operations=int(row["operations"]))
