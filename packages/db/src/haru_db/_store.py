"""The state store facade: compare-and-swap writes and consistent reads over one async engine.

Every write is ONE SQL statement in its own short transaction and reports whether it won; no
transaction ever spans two statements or external work. The statements live in modules of
their own, behind this class:

- :mod:`haru_db._exec`: statement execution and the per-call deadline;
- :mod:`haru_db._transitions`: domain and slot state CAS;
- :mod:`haru_db._operations`: the operation lifecycle (with :mod:`haru_db._postgres`, the
  PostgreSQL CTE builders, and :mod:`haru_db._cleanup`, the promote-failure cleanup rule);
- :mod:`haru_db._events`: the audit log;
- :mod:`haru_db._layout`: layout apply;
- :mod:`haru_db._reads`: snapshots, pointers and operations;
- :mod:`haru_db._prune`: retention (deleting old finished operations and events).

Every public method runs under the store's client-side deadline (``call_timeout_s``): a
database that stalls makes the call fail with :class:`~haru_db.StateStoreUnavailableError`
within that bound instead of hanging.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import (
    DomainLayout,
    DomainSnapshot,
    DomainState,
    Event,
    EventPayload,
    FleetLayout,
    FleetRef,
    FleetRoutePointer,
    FleetSnapshot,
    Operation,
    OperationError,
    OperationKind,
    OperationStep,
    SlotKind,
    SlotSpec,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from haru_db import (
    _certs,
    _client_keys,
    _config,
    _events,
    _layout,
    _operations,
    _provisioning,
    _prune,
    _reads,
    _transitions,
)
from haru_db._certs import DomainCert, StoredFleetCa
from haru_db._client_keys import ClientKey
from haru_db._engine import create_engine, translate_errors, writer
from haru_db._errors import StateStoreReadOnlyError
from haru_db._events import OperationEvent
from haru_db._exec import DEFAULT_CALL_TIMEOUT_S, Executor
from haru_db._layout import LayoutApplyResult, StoredPolicy
from haru_db._mirrors import SlotMirror
from haru_db._prune import DEFAULT_PRUNE_BATCH, KEEP_RECENT_OPERATIONS, PruneCounts
from haru_db._urls import Dialect, redact_database_url, resolve_database_url

__all__ = (
    "LayoutApplyResult",
    "OperationEvent",
    "PruneCounts",
    "SlotMirror",
    "StateStore",
    "check_writable",
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _bounded(
    method: Callable[Concatenate[StateStore, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[StateStore, _P], Coroutine[Any, Any, _R]]:
    """Run the whole facade call under the store's deadline."""

    async def call(self: StateStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await self._ex.bounded(method(self, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


class StateStore:
    """The repository of DESIGN 5.3 over one :class:`~sqlalchemy.ext.asyncio.AsyncEngine`.

    Create it with :meth:`open` and close it with :meth:`close`, inside the event loop that
    uses it (its connections belong to that loop). Every method is one short statement (reads
    included), so the store may be shared by any number of concurrent tasks and processes.
    Times are the caller's ``at`` (timezone-aware). Callers that share the store take them
    from one clock, the database's (:meth:`database_now`; the server samples it), so times
    written by different processes compare; the store itself never substitutes its own.
    Every method fails with :class:`~haru_db.StateStoreUnavailableError` when the database
    does not answer within ``call_timeout_s`` (a write's outcome is then unknown: re-read).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        url: str,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self._ex = Executor(engine, url=url, call_timeout_s=call_timeout_s)

    @classmethod
    def open(
        cls,
        url: str | None,
        *,
        statement_timeout_ms: int | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> StateStore:
        """Create a store for ``url`` (no connection is made until the first statement).

        Args:
            url: Any form :func:`haru_db.resolve_database_url` accepts (``None``: the embedded
                SQLite file in the working directory).
            statement_timeout_ms: PostgreSQL ``statement_timeout`` and
                ``idle_in_transaction_session_timeout`` (default: ``call_timeout_s``); on
                SQLite, how long a statement waits for another writer (default 5000 ms).
            call_timeout_s: The client-side deadline of every method (default 5 s).
        """
        if not call_timeout_s > 0:
            raise ValueError("call_timeout_s must be positive")
        resolved = resolve_database_url(url)
        engine = create_engine(
            resolved,
            statement_timeout_ms=statement_timeout_ms,
            call_timeout_s=call_timeout_s,
        )
        return cls(engine, url=resolved, call_timeout_s=call_timeout_s)

    @property
    def url(self) -> str:
        """The resolved URL (may carry a password: log :attr:`display_url` instead)."""
        return self._ex.url

    @property
    def display_url(self) -> str:
        """The resolved URL with its password redacted."""
        return redact_database_url(self._ex.url)

    @property
    def dialect(self) -> Dialect:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._ex.dialect

    @property
    def call_timeout_s(self) -> float:
        """The client-side deadline of every method, in seconds."""
        return self._ex.call_timeout_s

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._ex.close()

    # ---- state CAS -------------------------------------------------------------------------

    @_bounded
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
        return await _transitions.transition_domain(
            self._ex, domain_id, from_states=from_states, to=to, at=at
        )

    @_bounded
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
        return await _transitions.transition_slot(
            self._ex, slot_id, kind=kind, from_states=from_states, to=to, at=at
        )

    @_bounded
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
        return await _transitions.transition_domain_slots(
            self._ex, domain_id, kind=kind, from_states=from_states, to=to, at=at
        )

    @_bounded
    async def mark_domain_seen(self, domain_id: UUID, *, at: datetime) -> bool:
        """Record a heartbeat at ``at``.

        The stored time never moves backwards: a slow tick that reports an older heartbeat
        after a newer one loses (returns False).
        """
        return await _transitions.mark_domain_seen(self._ex, domain_id, at=at)

    @_bounded
    async def mark_domains_seen(
        self, domain_ids: Collection[UUID], *, at: datetime
    ) -> frozenset[UUID]:
        """Record a heartbeat at ``at`` for each of ``domain_ids``, in one statement.

        As :meth:`mark_domain_seen` for each domain: a domain whose stored heartbeat is newer
        than ``at`` keeps it.

        Returns:
            The domains whose heartbeat was recorded.
        """
        return await _transitions.mark_domains_seen(self._ex, domain_ids, at=at)

    @_bounded
    async def record_heartbeats(
        self, read: Mapping[UUID, datetime | None], *, at: datetime
    ) -> tuple[frozenset[UUID], frozenset[UUID]]:
        """Record a heartbeat at ``at`` for each domain of ``read`` (id: the stored time read).

        As :meth:`mark_domains_seen` (a domain whose stored heartbeat is newer than ``at``
        keeps it), and tells which writes replaced exactly the heartbeat the caller read: one
        compare-and-swap statement for those, then one plain statement for the others (a
        domain never seen, or whose stored heartbeat another process moved since the read).
        What a caller counts per replaced interval (the standby duty cycle) is then counted
        by one process only, however many replicas record the same domains.

        Returns:
            The domains whose heartbeat was recorded, and the part of them whose recorded
            write replaced the time read.
        """
        known = {domain_id: seen for domain_id, seen in read.items() if seen is not None}
        replaced = await _transitions.replace_domains_seen(self._ex, known, at=at)
        rest = [domain_id for domain_id in read if domain_id not in replaced]
        marked = await _transitions.mark_domains_seen(self._ex, rest, at=at)
        return replaced | marked, replaced

    @_bounded
    async def record_connect_failed(self, domain_id: UUID, *, at: datetime) -> bool:
        """Record that a proxy could not connect to ``domain_id``'s serving endpoint at ``at``.

        Refused or no route (never a timeout or an error answer). The stored time only moves
        forward; the domain's ``updated_at`` and the fleet's route pointer do not move. Read
        back as ``DomainSnapshot.connect_failed_at``.

        Returns:
            True when the stored time moved; False when a later one was stored already, or no
            such domain exists.
        """
        return await _transitions.record_connect_failed(self._ex, domain_id, at=at)

    @_bounded
    async def clamp_future_times(
        self, fleet_id: UUID, *, operation_ids: Collection[UUID] = (), at: datetime
    ) -> int:
        """Write ``at`` over the fleet's stored times that lie after it (domains, operations).

        Every domain of the fleet, and the operations ``operation_ids`` (of this fleet).

        A time from the future (a process whose clock ran fast, an older release) would make
        "time since it" stay zero for as long as it lies ahead: heartbeat staleness, step
        budgets, backoffs and grace periods would wait it out. Clamped, they count from
        ``at``. Two statements (domains, then operations), each idempotent and guarded by
        "later than ``at``", so a time written meanwhile by a correct clock is kept.

        Returns:
            How many rows changed.
        """
        return await _transitions.clamp_future_times(
            self._ex, fleet_id, operation_ids=operation_ids, at=at
        )

    @_bounded
    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool:
        """Raise the fleet's recorded route lease to ``lease_ms`` (it never lowers).

        A server process calls this before it routes the fleet with a lease of ``lease_ms``,
        so ``FleetSnapshot.route_lease_ms`` is the longest lease any process routes with.

        Returns:
            True when the stored lease was raised; False when it was already as long, or no
            such fleet exists.
        """
        if lease_ms < 0:
            raise ValueError(f"lease_ms must be >= 0, got {lease_ms}")
        return await _transitions.record_route_lease(self._ex, fleet_id, lease_ms)

    @_bounded
    async def claim_launch(self, domain_id: UUID, *, expected_attempt: int, at: datetime) -> bool:
        """Claim the next launch of a provisioned domain (``launch_attempt`` N to N + 1).

        Guarded on the domain being ``provisioning`` with ``launch_attempt == expected``: of
        racing processes exactly one wins, and a claim made before a crash is never made
        again for the same attempt. Clears the recorded addresses of the previous machine.
        """
        return await _provisioning.claim_launch(
            self._ex, domain_id, expected_attempt=expected_attempt, at=at
        )

    @_bounded
    async def mark_launched(self, domain_id: UUID, *, attempt: int, at: datetime) -> bool:
        """Record that launch ``attempt`` returned successfully (once)."""
        return await _provisioning.mark_launched(self._ex, domain_id, attempt=attempt, at=at)

    @_bounded
    async def record_domain_address(
        self,
        domain_id: UUID,
        *,
        attempt: int,
        supervisor_url: str | None,
        serving_base_url: str,
        model_urls: Mapping[str, str],
        at: datetime,
    ) -> bool:
        """Record the supervisor, serving base and per-model URLs of launch ``attempt``.

        One statement, guarded on the domain still provisioning that attempt. Snapshots fill
        each binding's ``servingUrl`` from ``model_urls``. ``supervisor_url`` is None for a
        ``skyserve`` domain (its replicas run no supervisor).
        """
        return await _provisioning.record_domain_address(
            self._ex,
            domain_id,
            attempt=attempt,
            supervisor_url=supervisor_url,
            serving_base_url=serving_base_url,
            model_urls=model_urls,
            at=at,
        )

    # ---- per-fleet CA of provisioned domains ----------------------------------------------

    @_bounded
    async def get_fleet_ca(self, fleet_id: UUID) -> StoredFleetCa | None:
        """The fleet's CA (certificate and sealed key), or None before its first launch."""
        return await _certs.get_fleet_ca(self._ex, fleet_id)

    @_bounded
    async def create_fleet_ca(
        self, fleet_id: UUID, *, cert_pem: str, sealed_key: str, at: datetime
    ) -> StoredFleetCa:
        """Store a CA for the fleet unless it has one; the one stored (the first wins)."""
        return await _certs.create_fleet_ca(
            self._ex, fleet_id, cert_pem=cert_pem, sealed_key=sealed_key, at=at
        )

    @_bounded
    async def record_domain_cert(self, cert: DomainCert) -> None:
        """Record the certificate issued to a domain, replacing the one of its last launch."""
        await _certs.record_domain_cert(self._ex, cert)

    @_bounded
    async def list_domain_certs(self, fleet_id: UUID) -> list[DomainCert]:
        """The certificates last issued to the fleet's domains."""
        return await _certs.list_domain_certs(self._ex, fleet_id)

    # ---- inference client keys -----------------------------------------------------------

    @_bounded
    async def create_client_key(
        self,
        key_id: UUID,
        *,
        name: str,
        key_hash: str,
        fleets: Sequence[UUID] | None,
        models: Sequence[str] | None,
        rpm: int | None,
        at: datetime,
    ) -> ClientKey:
        """Store a new client key by its SHA-256 (``key_hash``, 64 lower-case hex digits)."""
        return await _client_keys.create_client_key(
            self._ex,
            key_id,
            name=name,
            key_hash=key_hash,
            fleets=fleets,
            models=models,
            rpm=rpm,
            at=at,
        )

    @_bounded
    async def list_client_keys(self) -> list[ClientKey]:
        """Every client key, revoked ones included, oldest first."""
        return await _client_keys.list_client_keys(self._ex)

    @_bounded
    async def revoke_client_key(self, key_id: UUID, *, at: datetime) -> ClientKey | None:
        """Revoke a key (a second revocation keeps the first time); None: no such key."""
        return await _client_keys.revoke_client_key(self._ex, key_id, at=at)

    @_bounded
    async def client_key_by_hash(self, key_hash: str) -> ClientKey | None:
        """The key whose SHA-256 is ``key_hash`` (revoked or not), or None."""
        return await _client_keys.client_key_by_hash(self._ex, key_hash)

    @_bounded
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
        return await _transitions.escalate_domain_if_fleet_idle(
            self._ex,
            domain_id=domain_id,
            fleet_id=fleet_id,
            at=at,
            heartbeat_stale_ms=heartbeat_stale_ms,
        )

    # ---- operations ------------------------------------------------------------------------

    @_bounded
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

    @_bounded
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

    @_bounded
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

    @_bounded
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

    @_bounded
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
        return await _operations.fail_operation(
            self._ex,
            operation_id,
            error=error,
            at=at,
            expected_step=expected_step,
            target_not_routed=target_not_routed,
        )

    @_bounded
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

    @_bounded
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

    @_bounded
    async def list_events(self, fleet_id: UUID, *, after: int = 0, limit: int = 100) -> list[Event]:
        """Events of a fleet with ``id > after``, oldest first, at most ``limit`` (<= 1000)."""
        return await _events.list_events(self._ex, fleet_id, after=after, limit=limit)

    @_bounded
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

    # ---- layout ----------------------------------------------------------------------------

    @_bounded
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
        return await _layout.apply_fleet_layout(self._ex, layout, at=at)

    @_bounded
    async def get_fleet_policy(self, fleet_id: UUID) -> StoredPolicy | None:
        """The fleet's stored policy patch with its version (None: no such fleet).

        Raises:
            MalformedFleetStateError: The stored policy is not a JSON object.
        """
        return await _layout.get_fleet_policy(self._ex, fleet_id)

    @_bounded
    async def replace_fleet_policy(
        self, fleet_id: UUID, *, version: str, patch: Mapping[str, Any], at: datetime
    ) -> bool:
        """Store ``patch`` as the fleet's policy patch, only while it is still at ``version``.

        One compare-and-swap statement on the fleet row, guarded by the stored document's
        exact text (:attr:`StoredPolicy.version`). False when another writer changed the
        policy first (read it again and retry) or the fleet is gone. ``patch`` is stored as
        given: validate it (:class:`haru_protocol.PolicyPatch`) first. No event is appended.
        """
        return await _layout.replace_fleet_policy(
            self._ex, fleet_id, version=version, patch=patch, at=at
        )

    # ---- configuration (haru apply) --------------------------------------------------------

    @_bounded
    async def get_config_revisions(self, fleet_id: UUID) -> dict[tuple[str, UUID], int]:
        """The configuration revision of the fleet row and of each of its domains and slots.

        Keyed on ``("fleet" | "domain" | "slot", id)``; one statement. Read it before the
        snapshot a plan is made on: a change that lands in between then makes the plan's
        writes lose instead of applying a plan made on a newer view than its revisions.
        """
        return await _config.get_config_revisions(self._ex, fleet_id)

    @_bounded
    async def update_fleet_config(
        self,
        fleet_id: UUID,
        *,
        revision: int,
        display_name: str | None,
        policy: dict[str, Any],
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> int | None:
        """Set the fleet's display name and policy patch while its revision is ``revision``.

        ``events`` are appended (with the fleet, at ``at``) by the same statement, only when
        it lands; so are those of every configuration write below (with its domain and slot).

        Returns:
            The new revision, or None when the row moved on (or is gone).
        """
        return await _config.update_fleet_config(
            self._ex,
            fleet_id,
            revision=revision,
            display_name=display_name,
            policy=policy,
            at=at,
            events=events,
        )

    @_bounded
    async def update_domain_config(
        self,
        domain_id: UUID,
        *,
        fleet_id: UUID,
        revision: int,
        layout: DomainLayout,
        moves_traffic: bool,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> int | None:
        """Set a domain's URLs, placement and provisioning settings from ``layout``.

        Lands only while the domain's revision is ``revision``, it is not removed and no
        in-flight operation drives it, and (``moves_traffic``) while it is not the fleet's
        active domain. State columns are left alone.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.update_domain_config(
            self._ex,
            domain_id,
            fleet_id=fleet_id,
            revision=revision,
            layout=layout,
            moves_traffic=moves_traffic,
            at=at,
            events=events,
        )

    @_bounded
    async def remove_domain(
        self,
        domain_id: UUID,
        *,
        fleet_id: UUID,
        revision: int,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> int | None:
        """Remove a domain from its fleet (``removed_at``), with the guards of an update.

        Also lands only while the domain is not the fleet's active one. A provisioned domain
        in ``provisioning``, ``ready``, ``degraded`` or ``failed`` goes ``stopping`` in the same
        statement (the provisioner then tears it down, :meth:`list_removed_teardowns`). The
        row stays for its events and operations; reads of the fleet leave it out, and its slug
        can be added again. No operation can be created for it afterwards.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.remove_domain(
            self._ex, domain_id, fleet_id=fleet_id, revision=revision, at=at, events=events
        )

    @_bounded
    async def update_slot_spec(
        self,
        slot_id: UUID,
        *,
        fleet_id: UUID,
        domain_id: UUID,
        revision: int,
        spec: SlotSpec,
        moves_traffic: bool,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> int | None:
        """Replace a slot's spec, with the guards of :meth:`update_domain_config`.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.update_slot_spec(
            self._ex,
            slot_id,
            fleet_id=fleet_id,
            domain_id=domain_id,
            revision=revision,
            spec=spec,
            moves_traffic=moves_traffic,
            at=at,
            events=events,
        )

    @_bounded
    async def remove_slot(
        self,
        slot_id: UUID,
        *,
        fleet_id: UUID,
        domain_id: UUID,
        revision: int,
        moves_traffic: bool,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> int | None:
        """Remove a slot from its domain (``removed_at``), with the guards of an update.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.remove_slot(
            self._ex,
            slot_id,
            fleet_id=fleet_id,
            domain_id=domain_id,
            revision=revision,
            moves_traffic=moves_traffic,
            at=at,
            events=events,
        )

    @_bounded
    async def add_domain(
        self,
        fleet_id: UUID,
        layout: DomainLayout,
        *,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> UUID | None:
        """Insert a domain (``provisioning``) and its slots; None when its slug exists.

        ``events`` ride the domain's insert.
        """
        return await _config.add_domain(self._ex, fleet_id, layout, at=at, events=events)

    @_bounded
    async def add_slot(
        self,
        fleet_id: UUID,
        domain_id: UUID,
        spec: SlotSpec,
        *,
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> UUID | None:
        """Insert a slot into a stored domain, while no in-flight operation drives it.

        None when one of its GPU and kind exists, the domain is removed or an operation
        drives it. An inference slot starts ``serving`` on the active domain (decided by the
        insert against the live pointer), else ``sleeping``; a training slot starts ``idle``.
        """
        return await _config.add_slot(self._ex, fleet_id, domain_id, spec, at=at, events=events)

    # ---- reads -----------------------------------------------------------------------------

    @_bounded
    async def get_fleet_snapshot(self, ref: str | FleetRef) -> FleetSnapshot | None:
        """The fleet named by ``ref`` with its resolved policy, domains and slots.

        ``ref`` follows :func:`haru_protocol.parse_fleet_ref`: looked up as an id first when
        it is UUID-shaped (any case), then as a slug (case-sensitive); a reference that names
        nothing is None without a query. One statement reads everything, so the snapshot is
        consistent.

        Raises:
            MalformedFleetStateError: A stored row or JSON document fails validation.
        """
        return await _reads.get_fleet_snapshot(self._ex, ref)

    @_bounded
    async def list_removed_teardowns(self, fleet_id: UUID) -> list[DomainSnapshot]:
        """The fleet's removed domains still ``stopping`` (their teardown has not finished)."""
        return await _reads.list_removed_teardowns(self._ex, fleet_id)

    @_bounded
    async def get_fleet_route_pointer(self, ref: str | FleetRef) -> FleetRoutePointer | None:
        """The narrow routing read (id, slug, active domain, revision); ``ref`` as above."""
        return await _reads.get_fleet_route_pointer(self._ex, ref)

    @_bounded
    async def get_route_lease_ms(self, fleet_id: UUID) -> int | None:
        """The fleet's stored route lease (:meth:`record_route_lease`), or None (none, no fleet)."""
        return await _reads.get_route_lease_ms(self._ex, fleet_id)

    @_bounded
    async def list_fleets(self) -> list[FleetRoutePointer]:
        """Every fleet's routing pointer, ordered by slug (code point)."""
        return await _reads.list_fleets(self._ex)

    @_bounded
    async def get_in_flight_operation(self, fleet_id: UUID) -> Operation | None:
        """The fleet's pending or running operation, if any."""
        return await _operations.get_in_flight_operation(self._ex, fleet_id)

    @_bounded
    async def get_operation_fence(self, operation_id: UUID, step: OperationStep) -> int | None:
        """The fencing token of ``operation_id``'s ``step``: None unless it is running it.

        Every operation write (create, claim, advance, complete, fail) raises its fleet's
        fence by one in its own statement, so a process that read this token is behind as
        soon as the operation moves on; supervisors refuse its state-changing calls once they
        have seen a newer one (``X-Haru-Fence``).
        """
        return await _operations.get_operation_fence(self._ex, operation_id, step)

    @_bounded
    async def list_recent_operations(
        self, fleet_id: UUID, *, limit: int = KEEP_RECENT_OPERATIONS
    ) -> list[Operation]:
        """The fleet's newest ``limit`` operations (newest first): input of promotion backoff.

        Pruning (:meth:`prune_history`) keeps the newest :data:`KEEP_RECENT_OPERATIONS` of each
        fleet: a larger ``limit`` may see fewer operations than were ever made.
        """
        return await _operations.list_recent_operations(self._ex, fleet_id, limit=limit)

    @_bounded
    async def get_operation(
        self, operation_id: UUID, *, fleet_id: UUID | None = None
    ) -> Operation | None:
        """One operation by id (and fleet, when given)."""
        return await _reads.get_operation(self._ex, operation_id, fleet_id=fleet_id)

    # ---- retention -------------------------------------------------------------------------

    async def prune_history(
        self,
        *,
        before: datetime,
        keep_recent: int = KEEP_RECENT_OPERATIONS,
        batch: int = DEFAULT_PRUNE_BATCH,
        max_batches: int | None = None,
    ) -> PruneCounts:
        """Delete finished operations and events older than ``before``, in bounded batches.

        The rule (see :mod:`haru_db._prune`): an operation goes when it finished before
        ``before`` and is not among its fleet's newest ``keep_recent``; its events go with it;
        an event of no operation goes when created before ``before``; a relaunch streak's
        events of a domain that is not ready stay. In-flight operations and their events never
        go. Each batch is one statement of at most ``batch`` rows, under its own deadline
        (``call_timeout_s``); events go first, then the operations they no longer refer to.

        Args:
            before: The cutoff (the caller's clock minus the retention).
            keep_recent: Operations kept per fleet whatever their age.
            batch: Rows one statement deletes at most.
            max_batches: Statements this call runs at most (None: until nothing is left);
                the rest waits for the next call.

        Returns:
            How many events and operations were deleted.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        spent = 0
        counts = [0, 0]
        for index, step in enumerate((_prune.delete_events_batch, _prune.delete_operations_batch)):
            while max_batches is None or spent < max_batches:
                spent += 1
                deleted = await self._ex.bounded(
                    step(self._ex, before=before, keep_recent=keep_recent, batch=batch)
                )
                counts[index] += deleted
                if deleted < batch:
                    break
        return PruneCounts(events=counts[0], operations=counts[1])

    @_bounded
    async def count_prunable(
        self, *, before: datetime, keep_recent: int = KEEP_RECENT_OPERATIONS
    ) -> PruneCounts:
        """What :meth:`prune_history` with the same arguments would delete now (a dry run)."""
        return await _prune.count_prunable(self._ex, before=before, keep_recent=keep_recent)

    @_bounded
    async def ping(self) -> None:
        """Run ``SELECT 1``.

        Raises:
            StateStoreUnavailableError: The database cannot be reached.
        """
        await _reads.ping(self._ex)

    @_bounded
    async def database_now(self) -> datetime:
        """The database's clock, now (aware UTC): the time source shared by every process.

        PostgreSQL: ``clock_timestamp()`` of the server. SQLite: ``'now'``, the clock of the
        host that runs the statement; every process sharing one SQLite file runs on that host.
        The value is read when the statement runs, between the call and its return: time the
        call to bound the read's own error.

        Raises:
            StateStoreUnavailableError: The database cannot be reached.
        """
        return await _reads.database_now(self._ex)

    @_bounded
    async def check_writable(self) -> None:
        """Prove the database accepts writes (run it at start-up, before serving).

        SQLite: the database file (when it exists) and its directory must be writable by
        this process (WAL needs its ``-wal`` and ``-shm`` files next to it), and a write
        transaction must begin. PostgreSQL: the session must not be read-only (a hot
        standby, ``default_transaction_read_only``).

        Raises:
            StateStoreReadOnlyError: The database would refuse writes; the message says why.
            StateStoreUnavailableError: The database cannot be reached.
        """
        await check_writable(self._ex.url, engine=self._ex.engine)


async def check_writable(url: str | None, *, engine: AsyncEngine | None = None) -> None:
    """:meth:`StateStore.check_writable` for ``url`` (any form :func:`resolve_database_url` takes).

    Run it at start-up, after :func:`haru_db.upgrade`: a server must refuse to start on a
    database that would fail every write.

    Raises:
        StateStoreReadOnlyError: The database would refuse writes; the message says why.
        StateStoreUnavailableError: The database cannot be reached.
    """
    url = resolve_database_url(url)
    shown = redact_database_url(url)
    if make_url(url).get_backend_name() == "sqlite":
        _check_sqlite_paths(Path(str(make_url(url).database)), shown)
    own = engine is None
    active = create_engine(url) if engine is None else engine
    try:
        with translate_errors(url):
            if make_url(url).get_backend_name() == "sqlite":
                # BEGIN IMMEDIATE takes the write lock: a read-only file fails here.
                async with writer(active).begin() as conn:
                    await conn.execute(sa.text("SELECT 1"))
                return
            async with active.connect() as conn:
                result = await conn.execute(sa.text("SHOW transaction_read_only"))
                read_only = str(result.scalar_one()).lower() == "on"
        if read_only:
            raise StateStoreReadOnlyError(
                f"state store {shown} is read-only (a hot standby, or "
                "default_transaction_read_only is on): point DATABASE_URL at the primary"
            )
    finally:
        if own:
            await active.dispose()


def _check_sqlite_paths(path: Path, shown: str) -> None:
    directory = path.parent
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise StateStoreReadOnlyError(
            f"state store {shown}: the database file is not writable by this process; "
            "fix its permissions or point DATABASE_URL elsewhere"
        )
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        raise StateStoreReadOnlyError(
            f"state store {shown}: the directory {str(directory)!r} is not writable by this "
            "process (SQLite needs to create its journal files there); fix its permissions "
            "or point DATABASE_URL elsewhere"
        )
