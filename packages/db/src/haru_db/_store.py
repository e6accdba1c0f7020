"""The state store: compare-and-swap writes and consistent reads over one async engine.

Every write is ONE SQL statement in its own short transaction and reports whether it won; no
transaction ever spans two statements or external work. Two writes touch several tables at
once and stay single statements:

- ``fail_operation`` on a promote also fails the target's wake-path inference slots and returns
  its stopping training slots to training;
- ``switch_active`` moves the pointer and marks its operation ``routing_committed``.

PostgreSQL runs each as a data-modifying CTE; ``switch_active`` locks the operation row in
that CTE (``SELECT ... FOR UPDATE``) so that, under READ COMMITTED, a concurrent
``fail_operation(target_not_routed=True)`` either commits first (the switch then re-checks
``state = 'running'`` and loses) or waits and re-checks ``routing_committed = false`` (and
loses). SQLite has no data-modifying CTEs; triggers created by the migration do the other
table's half inside the same statement, and ``BEGIN IMMEDIATE`` serialises writers.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from haru_core import Machine as _Machine
from haru_core import assert_transition, machine_for
from haru_protocol import (
    DomainState,
    Event,
    EventType,
    FleetLayout,
    FleetRoutePointer,
    FleetSnapshot,
    InferenceSlotSpec,
    InferenceSlotState,
    Operation,
    OperationError,
    OperationKind,
    OperationState,
    OperationStep,
    SlotKind,
    TrainingSlotState,
    is_slug,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from haru_db._engine import create_engine, reader, translate_errors, writer
from haru_db._errors import HaruDbError
from haru_db._rows import (
    Row,
    event_from_row,
    malformed,
    operation_from_row,
    pointer_from_row,
    snapshot_from_rows,
)
from haru_db._tables import IN_FLIGHT_STATES, domains, events, fleets, operations, slots
from haru_db._urls import Dialect, dialect_of, redact_database_url, resolve_database_url

logger = logging.getLogger(__name__)

_UUID_RE = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)
_CREATE_OPERATION_ATTEMPTS = 5
_MAX_EVENT_PAGE = 1000
_MAX_EVENT_TYPE = 128

_RUNNING = OperationState.RUNNING.value
_PENDING = OperationState.PENDING.value
_I = InferenceSlotState
_T = TrainingSlotState

# Slot changes fail_operation applies to a promote's target in the same statement.
_WAKE_PATH_STATES = (_I.WAKING.value, _I.PROBING.value)
_PROMOTE_FAIL_SLOT_CHANGES: tuple[tuple[_Machine, str, str], ...] = (
    ("inference", _I.WAKING.value, _I.FAILED.value),
    ("inference", _I.PROBING.value, _I.FAILED.value),
    ("inference", _I.SERVING.value, _I.FAILED.value),
    ("training", _T.STOPPING.value, _T.TRAINING.value),
)


@dataclass(frozen=True, slots=True)
class LayoutApplyResult:
    """What :meth:`StateStore.apply_fleet_layout` created (all zero/False on a re-apply)."""

    fleet_id: UUID
    """The fleet the layout describes (created now or found by slug)."""
    fleet_created: bool
    domains_created: int
    slots_created: int
    pointer_set: bool
    """Whether this apply set the routing pointer to the declared active domain."""

    @property
    def changed(self) -> bool:
        """Whether the apply created or moved anything."""
        return (
            self.fleet_created
            or self.domains_created > 0
            or self.slots_created > 0
            or self.pointer_set
        )


def _aware(at: datetime) -> datetime:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"timestamps must be timezone-aware: {at!r}")
    return at


def _checked_froms(machine: _Machine, from_states: Collection[str], to: str) -> list[str]:
    froms = sorted({str(s) for s in from_states})
    for state in froms:
        assert_transition(machine, state, str(to))
    return froms


class StateStore:
    """The repository of SPEC 5.3 over one :class:`~sqlalchemy.ext.asyncio.AsyncEngine`.

    Create it with :meth:`open` and close it with :meth:`close`, inside the event loop that
    uses it (its connections belong to that loop). Every method is one short statement (reads
    included), so the store may be shared by any number of concurrent tasks and processes.
    Times are the caller's clock (timezone-aware); the database clock is never used for state.
    """

    def __init__(self, engine: AsyncEngine, *, url: str) -> None:
        self._engine = engine
        self._writer = writer(engine)
        self._reader = reader(engine)
        self._url = url
        self._dialect: Dialect = dialect_of(url)

    @classmethod
    def open(cls, url: str | None, *, statement_timeout_ms: int | None = None) -> StateStore:
        """Create a store for ``url`` (no connection is made until the first statement).

        Args:
            url: Any form :func:`haru_db.resolve_database_url` accepts (``None``: the embedded
                SQLite file in the working directory).
            statement_timeout_ms: PostgreSQL ``statement_timeout``; on SQLite, how long a
                statement waits for another writer (default 5000 ms).
        """
        resolved = resolve_database_url(url)
        return cls(create_engine(resolved, statement_timeout_ms=statement_timeout_ms), url=resolved)

    @property
    def url(self) -> str:
        """The resolved URL (may carry a password: log :attr:`display_url` instead)."""
        return self._url

    @property
    def display_url(self) -> str:
        """The resolved URL with its password redacted."""
        return redact_database_url(self._url)

    @property
    def dialect(self) -> Dialect:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._dialect

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._engine.dispose()

    # ---- execution -------------------------------------------------------------------------

    async def _write(self, stmt: sa.Executable) -> list[Row]:
        with translate_errors(self._url):
            async with self._writer.begin() as conn:
                result = await conn.execute(stmt)
                with malformed("stored row"):
                    return [dict(r) for r in result.mappings().all()] if result.returns_rows else []

    async def _read(self, stmt: sa.Executable) -> list[Row]:
        # One statement, its own implicit transaction (see haru_db._engine.reader). A read is
        # retried once when the pooled connection turns out dead (SQLAlchemy then invalidates
        # the pool's older connections); a write is never retried.
        with translate_errors(self._url):
            try:
                return await self._read_once(stmt)
            except sa_exc.DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                logger.info("state store connection dropped; retrying the read once")
            return await self._read_once(stmt)

    async def _read_once(self, stmt: sa.Executable) -> list[Row]:
        async with self._reader.connect() as conn:
            result = await conn.execute(stmt)
            with malformed("stored row"):
                return [dict(r) for r in result.mappings().all()]

    def _insert(self, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
        if self._dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    # ---- state CAS -------------------------------------------------------------------------

    async def transition_domain(
        self,
        domain_id: UUID,
        *,
        from_states: Collection[DomainState],
        to: DomainState,
        at: datetime,
    ) -> bool:
        """Move a domain to ``to`` if its state is one of ``from_states``.

        Raises:
            haru_core.InvalidTransitionError: A (from, to) pair the domain table forbids.
        """
        froms = _checked_froms("domain", from_states, to)
        at = _aware(at)
        if not froms:
            return False
        stmt = (
            sa.update(domains)
            .where(domains.c.id == domain_id, domains.c.state.in_(froms))
            .values(state=str(to), state_updated_at=at, updated_at=at)
            .returning(domains.c.id)
        )
        return bool(await self._write(stmt))

    async def transition_slot(
        self,
        slot_id: UUID,
        *,
        kind: SlotKind,
        from_states: Collection[str],
        to: str,
        at: datetime,
    ) -> bool:
        """Move one slot of ``kind`` to ``to`` if its state is one of ``from_states``.

        Raises:
            haru_core.InvalidTransitionError: A pair the kind's table forbids (a state of the
                other kind included).
        """
        froms = _checked_froms(machine_for(kind), from_states, to)
        at = _aware(at)
        if not froms:
            return False
        stmt = (
            sa.update(slots)
            .where(slots.c.id == slot_id, slots.c.kind == str(kind), slots.c.state.in_(froms))
            .values(state=str(to), state_updated_at=at, updated_at=at)
            .returning(slots.c.id)
        )
        return bool(await self._write(stmt))

    async def transition_domain_slots(
        self,
        domain_id: UUID,
        *,
        kind: SlotKind,
        from_states: Collection[str],
        to: str,
        at: datetime,
    ) -> int:
        """Move every slot of ``kind`` in a domain whose state is in ``from_states``.

        Returns:
            How many slots moved.
        """
        froms = _checked_froms(machine_for(kind), from_states, to)
        at = _aware(at)
        if not froms:
            return 0
        stmt = (
            sa.update(slots)
            .where(
                slots.c.domain_id == domain_id,
                slots.c.kind == str(kind),
                slots.c.state.in_(froms),
            )
            .values(state=str(to), state_updated_at=at, updated_at=at)
            .returning(slots.c.id)
        )
        return len(await self._write(stmt))

    async def mark_domain_seen(self, domain_id: UUID, *, at: datetime) -> bool:
        """Record a heartbeat at ``at``.

        The stored time never moves backwards: a slow tick that reports an older heartbeat
        after a newer one loses (returns False).
        """
        at = _aware(at)
        stmt = (
            sa.update(domains)
            .where(
                domains.c.id == domain_id,
                sa.or_(domains.c.last_seen_at.is_(None), domains.c.last_seen_at <= at),
            )
            .values(last_seen_at=at, updated_at=at)
            .returning(domains.c.id)
        )
        return bool(await self._write(stmt))

    # ---- operations ------------------------------------------------------------------------

    async def create_operation(
        self,
        *,
        fleet_id: UUID,
        kind: OperationKind,
        target_domain_id: UUID,
        at: datetime,
    ) -> tuple[Operation, bool]:
        """Insert a pending operation, or join the fleet's in-flight one.

        The source domain is the fleet's routing pointer, read inside the insert statement.

        Returns:
            ``(operation, True)`` when created; ``(in_flight_operation, False)`` when another
            operation was already in flight (whatever its kind and target).

        Raises:
            ConstraintViolationError: Unknown fleet, or a target outside the fleet.
        """
        at = _aware(at)
        source = sa.select(fleets.c.active_domain_id).where(fleets.c.id == fleet_id)
        for _ in range(_CREATE_OPERATION_ATTEMPTS):
            stmt = (
                self._insert(operations)
                .values(
                    id=uuid4(),
                    fleet_id=fleet_id,
                    kind=str(kind),
                    state=_PENDING,
                    target_domain_id=target_domain_id,
                    source_domain_id=source.scalar_subquery(),
                    routing_committed=False,
                    created_at=at,
                    updated_at=at,
                )
                # Only the one-in-flight index can conflict (the id is fresh).
                .on_conflict_do_nothing()
                .returning(*operations.c)
            )
            rows = await self._write(stmt)
            if rows:
                return operation_from_row(rows[0]), True
            existing = await self.get_in_flight_operation(fleet_id)
            if existing is not None:
                return existing, False
            # The in-flight operation finished between the two statements: try again.
        raise HaruDbError(
            f"could not create an operation for fleet {fleet_id}: in-flight operations kept "
            f"finishing in between ({_CREATE_OPERATION_ATTEMPTS} attempts)"
        )

    async def claim_operation(
        self, operation_id: UUID, *, first_step: OperationStep, at: datetime
    ) -> bool:
        """Start a pending operation at ``first_step`` (pending -> running)."""
        at = _aware(at)
        stmt = (
            sa.update(operations)
            .where(operations.c.id == operation_id, operations.c.state == _PENDING)
            .values(
                state=_RUNNING,
                current_step=str(first_step),
                step_started_at=at,
                updated_at=at,
            )
            .returning(operations.c.id)
        )
        return bool(await self._write(stmt))

    async def advance_step(
        self,
        operation_id: UUID,
        *,
        from_step: OperationStep,
        to_step: OperationStep,
        at: datetime,
    ) -> bool:
        """Move a running operation from ``from_step`` to ``to_step`` (restarting the budget)."""
        at = _aware(at)
        stmt = (
            sa.update(operations)
            .where(
                operations.c.id == operation_id,
                operations.c.state == _RUNNING,
                operations.c.current_step == str(from_step),
            )
            .values(current_step=str(to_step), step_started_at=at, updated_at=at)
            .returning(operations.c.id)
        )
        return bool(await self._write(stmt))

    async def complete_operation(
        self, operation_id: UUID, *, from_step: OperationStep, at: datetime
    ) -> bool:
        """Finish a running operation at ``from_step`` as succeeded."""
        at = _aware(at)
        stmt = (
            sa.update(operations)
            .where(
                operations.c.id == operation_id,
                operations.c.state == _RUNNING,
                operations.c.current_step == str(from_step),
            )
            .values(state=OperationState.SUCCEEDED.value, finished_at=at, updated_at=at)
            .returning(operations.c.id)
        )
        return bool(await self._write(stmt))

    async def fail_operation(
        self,
        operation_id: UUID,
        *,
        error: OperationError,
        at: datetime,
        expected_step: OperationStep | None = None,
        target_not_routed: bool = False,
    ) -> bool:
        """Fail an in-flight operation; for a promote, clean up its target in the same statement.

        Guards: state pending or running; ``current_step == expected_step`` when given;
        ``routing_committed = false`` when ``target_not_routed``. For a promote the same
        statement fails the target's inference slots in ``waking``/``probing`` (and
        ``serving`` unless the pointer is at the target) and returns its ``stopping`` training
        slots to ``training``, so a retry never observes half-cleaned state.
        """
        for machine, from_state, to_state in _PROMOTE_FAIL_SLOT_CHANGES:
            assert_transition(machine, from_state, to_state)
        at = _aware(at)
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
        if self._dialect == "sqlite":
            # trg_operations_promote_failed_cleanup does the slots' half in this statement.
            return bool(await self._write(fail.returning(operations.c.id)))
        return bool(await self._write(_postgres_fail_with_cleanup(fail, at=at)))

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
        at = _aware(at)
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
        move = {
            "active_domain_id": target_domain_id,
            "route_revision": fleets.c.route_revision + 1,
            "last_switch_operation_id": operation_id,
            "updated_at": at,
        }
        if self._dialect == "sqlite":
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
            return bool(await self._write(stmt))
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
        switch = sa.select(moved.c.id, sa.select(marked.c.id).scalar_subquery().label("op"))
        return bool(await self._write(switch))

    async def escalate_domain_if_fleet_idle(
        self,
        *,
        domain_id: UUID,
        fleet_id: UUID,
        at: datetime,
        heartbeat_stale_ms: int,
    ) -> bool:
        """Fail a degraded active domain, only while a failover could follow (one statement).

        Guards, all in the same statement: the domain is degraded and the fleet's pointer
        targets it; the fleet has no in-flight operation; a viable standby exists (another
        domain of the fleet, ready, with a supervisor URL, seen at or after
        ``at - heartbeat_stale_ms``, with at least one inference slot and none failed).
        """
        assert_transition("domain", DomainState.DEGRADED.value, DomainState.FAILED.value)
        at = _aware(at)
        if heartbeat_stale_ms < 0:
            raise ValueError("heartbeat_stale_ms must not be negative")
        fresh_since = at - timedelta(milliseconds=heartbeat_stale_ms)
        standby = domains.alias("standby")
        inference_slot = sa.and_(
            slots.c.domain_id == standby.c.id, slots.c.kind == SlotKind.INFERENCE.value
        )
        viable_standby = sa.exists(
            sa.select(standby.c.id).where(
                standby.c.fleet_id == fleet_id,
                standby.c.id != domain_id,
                standby.c.state == DomainState.READY.value,
                standby.c.supervisor_url.is_not(None),
                standby.c.last_seen_at >= fresh_since,
                sa.exists(sa.select(slots.c.id).where(inference_slot)),
                ~sa.exists(
                    sa.select(slots.c.id).where(inference_slot, slots.c.state == _I.FAILED.value)
                ),
            )
        )
        stmt = (
            sa.update(domains)
            .where(
                domains.c.id == domain_id,
                domains.c.fleet_id == fleet_id,
                domains.c.state == DomainState.DEGRADED.value,
                sa.exists(
                    sa.select(fleets.c.id).where(
                        fleets.c.id == fleet_id, fleets.c.active_domain_id == domain_id
                    )
                ),
                ~sa.exists(
                    sa.select(operations.c.id).where(
                        operations.c.fleet_id == fleet_id,
                        operations.c.state.in_(IN_FLIGHT_STATES),
                    )
                ),
                viable_standby,
            )
            .values(state=DomainState.FAILED.value, state_updated_at=at, updated_at=at)
            .returning(domains.c.id)
        )
        return bool(await self._write(stmt))

    # ---- events ----------------------------------------------------------------------------

    async def append_event(
        self,
        *,
        fleet_id: UUID,
        type: str,
        payload: Mapping[str, object],
        at: datetime,
        domain_id: UUID | None = None,
        slot_id: UUID | None = None,
        operation_id: UUID | None = None,
    ) -> int:
        """Append one audit event.

        Returns:
            The event id (increasing; pass the last one seen as ``after`` to
            :meth:`list_events`).

        Raises:
            TypeError: ``payload`` is not strict JSON (a datetime, NaN, ...).
            ValueError: ``type`` is empty or longer than 128 characters.
            ConstraintViolationError: An unknown fleet, domain, slot or operation id.
        """
        at = _aware(at)
        if not 1 <= len(type) <= _MAX_EVENT_TYPE:
            raise ValueError(f"event type must be 1 to {_MAX_EVENT_TYPE} characters")
        document = dict(payload)
        try:
            # Strict JSON: NaN/Infinity would be stored by SQLite and refused by PostgreSQL.
            json.dumps(document, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"event payload is not JSON-serializable: {exc}") from exc
        stmt = (
            sa.insert(events)
            .values(
                fleet_id=fleet_id,
                domain_id=domain_id,
                slot_id=slot_id,
                operation_id=operation_id,
                type=type,
                payload=document,
                created_at=at,
            )
            .returning(events.c.id)
        )
        rows = await self._write(stmt)
        return int(rows[0]["id"])

    async def list_events(self, fleet_id: UUID, *, after: int = 0, limit: int = 100) -> list[Event]:
        """Events of a fleet with ``id > after``, oldest first, at most ``limit`` (<= 1000)."""
        if after < 0:
            raise ValueError("after must not be negative")
        if not 1 <= limit <= _MAX_EVENT_PAGE:
            raise ValueError(f"limit must be between 1 and {_MAX_EVENT_PAGE}")
        stmt = (
            sa.select(events)
            .where(events.c.fleet_id == fleet_id, events.c.id > after)
            .order_by(events.c.id)
            .limit(limit)
        )
        return [event_from_row(row) for row in await self._read(stmt)]

    # ---- layout ----------------------------------------------------------------------------

    async def apply_fleet_layout(self, layout: FleetLayout, *, at: datetime) -> LayoutApplyResult:
        """Create what the layout declares and the store lacks (idempotent and additive).

        Insert-if-absent for the fleet (by slug), its domains (by slug) and their slots (by
        GPU index and kind); existing rows are left untouched, the stored policy included. Every
        new domain starts ``provisioning`` (not routable, not promotable) until a heartbeat
        confirms it. A new inference slot's state
        is decided inside its insert against the live pointer: ``serving`` on the active
        domain (or on the declared active while the pointer is unset), else ``sleeping``;
        training slots start ``idle``. When the pointer is unset and the declared active's
        inference slots are all serving, the pointer is set (revision + 1). When anything was
        created, a ``fleet.layout.applied`` event records the counts. Safe to run
        concurrently: each step is one statement that ignores rows a racer inserted.
        """
        at = _aware(at)
        fleet_id, fleet_created = await self._ensure_fleet(layout, at=at)
        domains_created = await self._ensure_domains(fleet_id, layout, at=at)
        domain_ids = await self._domain_ids(fleet_id)
        declared = layout.active_domain_slug
        slots_created = await self._ensure_slots(fleet_id, domain_ids, layout, at=at)
        pointer_set = False
        if declared is not None and declared in domain_ids:
            pointer_set = await self._set_initial_pointer(fleet_id, domain_ids[declared], at=at)
        result = LayoutApplyResult(
            fleet_id=fleet_id,
            fleet_created=fleet_created,
            domains_created=domains_created,
            slots_created=slots_created,
            pointer_set=pointer_set,
        )
        if result.changed:
            await self.append_event(
                fleet_id=fleet_id,
                type=EventType.FLEET_LAYOUT_APPLIED.value,
                payload={
                    "fleetCreated": fleet_created,
                    "domainsCreated": domains_created,
                    "slotsCreated": slots_created,
                    "pointerSet": pointer_set,
                },
                at=at,
            )
        logger.info(
            "layout %s applied: fleet created %s, %d domains, %d slots, pointer set %s",
            layout.slug,
            fleet_created,
            domains_created,
            slots_created,
            pointer_set,
        )
        return result

    async def _ensure_fleet(self, layout: FleetLayout, *, at: datetime) -> tuple[UUID, bool]:
        policy = {} if layout.policy is None else layout.policy.stored()
        stmt = (
            self._insert(fleets)
            .values(
                id=uuid4(),
                slug=layout.slug,
                display_name=layout.display_name,
                active_domain_id=None,
                route_revision=1,
                policy=policy,
                created_at=at,
                updated_at=at,
            )
            .on_conflict_do_nothing(index_elements=[fleets.c.slug])
            .returning(fleets.c.id)
        )
        rows = await self._write(stmt)
        if rows:
            return rows[0]["id"], True
        found = await self._read(sa.select(fleets.c.id).where(fleets.c.slug == layout.slug))
        if not found:  # pragma: no cover - fleets are never deleted
            raise HaruDbError(f"fleet {layout.slug!r} vanished while applying its layout")
        return found[0]["id"], False

    async def _ensure_domains(self, fleet_id: UUID, layout: FleetLayout, *, at: datetime) -> int:
        values = [
            {
                "id": uuid4(),
                "fleet_id": fleet_id,
                "slug": d.slug,
                # Every new domain, static included, waits for its first good heartbeat:
                # nothing routes to endpoints no supervisor has confirmed.
                "state": DomainState.PROVISIONING.value,
                "provider": d.provider.value,
                "placement": d.placement.model_dump(mode="json"),
                "supervisor_url": d.supervisor_url,
                "serving_base_url": d.serving_base_url,
                "last_seen_at": None,
                "state_updated_at": at,
                "created_at": at,
                "updated_at": at,
            }
            for d in layout.domains
        ]
        stmt = (
            self._insert(domains)
            .values(values)
            .on_conflict_do_nothing(index_elements=[domains.c.fleet_id, domains.c.slug])
            .returning(domains.c.id)
        )
        return len(await self._write(stmt))

    async def _domain_ids(self, fleet_id: UUID) -> dict[str, UUID]:
        rows = await self._read(
            sa.select(domains.c.id, domains.c.slug).where(domains.c.fleet_id == fleet_id)
        )
        return {str(r["slug"]): r["id"] for r in rows}

    async def _ensure_slots(
        self,
        fleet_id: UUID,
        domain_ids: Mapping[str, UUID],
        layout: FleetLayout,
        *,
        at: datetime,
    ) -> int:
        values: list[dict[str, Any]] = []
        for domain in layout.domains:
            domain_id = domain_ids[domain.slug]
            for spec in domain.slots:
                if isinstance(spec, InferenceSlotSpec):
                    state: Any = _initial_inference_state(
                        fleet_id,
                        domain_id,
                        declared_active=domain.slug == layout.active_domain_slug,
                    )
                else:
                    state = _T.IDLE.value
                values.append(
                    {
                        "id": uuid4(),
                        "domain_id": domain_id,
                        "gpu_index": spec.gpu_index,
                        "kind": spec.kind.value,
                        "state": state,
                        "spec": spec.model_dump(mode="json"),
                        "state_updated_at": at,
                        "created_at": at,
                        "updated_at": at,
                    }
                )
        if not values:  # pragma: no cover - a layout domain has at least one slot
            return 0
        stmt = (
            self._insert(slots)
            .values(values)
            .on_conflict_do_nothing(
                index_elements=[slots.c.domain_id, slots.c.gpu_index, slots.c.kind]
            )
            .returning(slots.c.id)
        )
        return len(await self._write(stmt))

    async def _set_initial_pointer(self, fleet_id: UUID, domain_id: UUID, *, at: datetime) -> bool:
        inference = sa.and_(
            slots.c.domain_id == domain_id, slots.c.kind == SlotKind.INFERENCE.value
        )
        stmt = (
            sa.update(fleets)
            .where(
                fleets.c.id == fleet_id,
                fleets.c.active_domain_id.is_(None),
                sa.exists(sa.select(slots.c.id).where(inference)),
                ~sa.exists(
                    sa.select(slots.c.id).where(inference, slots.c.state != _I.SERVING.value)
                ),
            )
            .values(
                active_domain_id=domain_id,
                route_revision=fleets.c.route_revision + 1,
                # Not an operation's switch: keeps the SQLite routing trigger quiet.
                last_switch_operation_id=None,
                updated_at=at,
            )
            .returning(fleets.c.id)
        )
        return bool(await self._write(stmt))

    # ---- reads -----------------------------------------------------------------------------

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None:
        """The fleet named by ``ref`` with its resolved policy, domains and slots.

        ``ref`` is looked up as an id first when it is UUID-shaped (any case), then as a slug
        (case-sensitive). One statement reads everything, so the snapshot is consistent.

        Raises:
            MalformedFleetStateError: A stored row or JSON document fails validation.
        """
        match = _fleet_match(ref)
        if match is None:
            return None
        d = domains
        s = slots
        stmt = (
            sa.select(
                *(c.label(f"f_{c.name}") for c in fleets.c),
                *(c.label(f"d_{c.name}") for c in d.c),
                *(c.label(f"s_{c.name}") for c in s.c),
            )
            .select_from(
                fleets.outerjoin(d, d.c.fleet_id == fleets.c.id).outerjoin(
                    s, s.c.domain_id == d.c.id
                )
            )
            .where(match)
        )
        rows = await self._read(stmt)
        chosen = _choose_fleet(ref, rows, id_key="f_id")
        if chosen is None:
            return None
        return snapshot_from_rows([r for r in rows if r["f_id"] == chosen])

    async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None:
        """The narrow routing read (id, slug, active domain, revision); ``ref`` as above."""
        match = _fleet_match(ref)
        if match is None:
            return None
        stmt = sa.select(
            fleets.c.id, fleets.c.slug, fleets.c.active_domain_id, fleets.c.route_revision
        ).where(match)
        rows = await self._read(stmt)
        chosen = _choose_fleet(ref, rows, id_key="id")
        if chosen is None:
            return None
        return pointer_from_row(next(r for r in rows if r["id"] == chosen))

    async def list_fleets(self) -> list[FleetRoutePointer]:
        """Every fleet's routing pointer, ordered by slug (code point)."""
        rows = await self._read(
            sa.select(
                fleets.c.id, fleets.c.slug, fleets.c.active_domain_id, fleets.c.route_revision
            )
        )
        return sorted((pointer_from_row(r) for r in rows), key=lambda p: p.slug)

    async def get_in_flight_operation(self, fleet_id: UUID) -> Operation | None:
        """The fleet's pending or running operation, if any."""
        stmt = sa.select(operations).where(
            operations.c.fleet_id == fleet_id, operations.c.state.in_(IN_FLIGHT_STATES)
        )
        rows = await self._read(stmt)
        return operation_from_row(rows[0]) if rows else None

    async def list_recent_operations(self, fleet_id: UUID, *, limit: int = 64) -> list[Operation]:
        """The fleet's newest ``limit`` operations (newest first): input of promotion backoff."""
        stmt = (
            sa.select(operations)
            .where(operations.c.fleet_id == fleet_id)
            .order_by(operations.c.created_at.desc())
            .limit(limit)
        )
        return [operation_from_row(row) for row in await self._read(stmt)]

    async def get_operation(
        self, operation_id: UUID, *, fleet_id: UUID | None = None
    ) -> Operation | None:
        """One operation by id (and fleet, when given)."""
        stmt = sa.select(operations).where(operations.c.id == operation_id)
        if fleet_id is not None:
            stmt = stmt.where(operations.c.fleet_id == fleet_id)
        rows = await self._read(stmt)
        return operation_from_row(rows[0]) if rows else None

    async def ping(self) -> None:
        """Run ``SELECT 1``.

        Raises:
            StateStoreUnavailableError: The database cannot be reached.
        """
        await self._read(sa.select(sa.literal(1).label("ok")))


def _initial_inference_state(
    fleet_id: UUID, domain_id: UUID, *, declared_active: bool
) -> sa.ScalarSelect[Any]:
    # Evaluated by the INSERT itself, so a pointer that moves between statements is honoured.
    on_active = fleets.c.active_domain_id == domain_id
    if declared_active:
        on_active = sa.or_(on_active, fleets.c.active_domain_id.is_(None))
    return (
        sa.select(sa.case((on_active, _I.SERVING.value), else_=_I.SLEEPING.value))
        .where(fleets.c.id == fleet_id)
        .scalar_subquery()
    )


def _postgres_fail_with_cleanup(fail: sa.Update, *, at: datetime) -> sa.Select[Any]:
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
                slots.c.state.in_(_WAKE_PATH_STATES),
                sa.and_(slots.c.state == _I.SERVING.value, ~pointer_at_target),
            ),
        )
        .values(state=_I.FAILED.value, state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
        .cte("failed_inference_slots")
    )
    training = (
        sa.update(slots)
        .where(
            on_target,
            slots.c.kind == SlotKind.TRAINING.value,
            slots.c.state == _T.STOPPING.value,
        )
        .values(state=_T.TRAINING.value, state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
        .cte("resumed_training_slots")
    )
    # Every data-modifying CTE must be referenced for SQLAlchemy to render it.
    return sa.select(
        failed.c.id,
        sa.select(sa.func.count()).select_from(inference).scalar_subquery().label("inference"),
        sa.select(sa.func.count()).select_from(training).scalar_subquery().label("training"),
    )


def _fleet_match(ref: str) -> sa.ColumnElement[bool] | None:
    by_slug = fleets.c.slug == ref if is_slug(ref) else None
    if _UUID_RE.match(ref):
        by_id = fleets.c.id == UUID(ref)
        return by_id if by_slug is None else sa.or_(by_id, by_slug)
    return by_slug


def _choose_fleet(ref: str, rows: Sequence[Row], *, id_key: str) -> UUID | None:
    # An id match wins over a slug that happens to look like a UUID (SPEC 3.1).
    ids = {r[id_key] for r in rows}
    if _UUID_RE.match(ref) and UUID(ref) in ids:
        return UUID(ref)
    return next(iter(ids), None)
