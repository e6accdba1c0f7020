"""The state store's domain and slot state writes (part of :class:`~haru_db.StateStore`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from uuid import UUID

from haru_protocol import (
    DomainState,
    EventPayload,
    SlotKind,
)

from haru_db import (
    _provisioning,
    _transitions,
)
from haru_db._facade import Facade, bounded


class StateWrites(Facade):
    """Domain and slot CAS, heartbeats, launches and the idle-fleet escalation."""

    # ---- state CAS -------------------------------------------------------------------------

    @bounded
    async def transition_domain(
        self,
        domain_id: UUID,
        *,
        from_states: Collection[DomainState],
        to: DomainState,
        at: datetime,
        events: Sequence[EventPayload] = (),
        fleet_id: UUID | None = None,
        operation_id: UUID | None = None,
    ) -> bool:
        """Move a domain to ``to`` if its state is one of ``from_states``.

        ``events`` (about this change) are appended by the same statement, only when the
        move lands, stored with ``fleet_id`` (the domain's fleet), the domain, ``at`` and
        ``operation_id`` (the operation they are about, if any).

        Raises:
            haru_core.InvalidTransitionError: A (from, to) pair the domain table forbids.
            ValueError: ``events`` without ``fleet_id``.
        """
        return await _transitions.transition_domain(
            self._ex,
            domain_id,
            from_states=from_states,
            to=to,
            at=at,
            events=events,
            fleet_id=fleet_id,
            operation_id=operation_id,
        )

    @bounded
    async def transition_slot(
        self,
        slot_id: UUID,
        *,
        kind: SlotKind,
        from_states: Collection[str],
        to: str,
        at: datetime,
        events: Sequence[EventPayload] = (),
        fleet_id: UUID | None = None,
        domain_id: UUID | None = None,
    ) -> bool:
        """Move one slot of ``kind`` to ``to`` if its state is one of ``from_states``.

        ``events`` (about this change) are appended by the same statement, only when the
        move lands, stored with ``fleet_id`` and ``domain_id`` (the slot's fleet and
        domain), the slot and ``at``.

        Raises:
            haru_core.InvalidTransitionError: A pair the kind's table forbids (a state of the
                other kind included).
            ValueError: ``events`` without ``fleet_id`` or ``domain_id``.
        """
        return await _transitions.transition_slot(
            self._ex,
            slot_id,
            kind=kind,
            from_states=from_states,
            to=to,
            at=at,
            events=events,
            fleet_id=fleet_id,
            domain_id=domain_id,
        )

    @bounded
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

    @bounded
    async def mark_domain_seen(self, domain_id: UUID, *, at: datetime) -> bool:
        """Record a heartbeat at ``at``.

        The stored time never moves backwards: a slow tick that reports an older heartbeat
        after a newer one loses (returns False).
        """
        return await _transitions.mark_domain_seen(self._ex, domain_id, at=at)

    @bounded
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

    @bounded
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

    @bounded
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

    @bounded
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

    @bounded
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

    @bounded
    async def claim_launch(
        self,
        domain_id: UUID,
        *,
        expected_attempt: int,
        at: datetime,
        events: Sequence[EventPayload] = (),
        fleet_id: UUID | None = None,
    ) -> bool:
        """Claim the next launch of a provisioned domain (``launch_attempt`` N to N + 1).

        Guarded on the domain being ``provisioning`` with ``launch_attempt == expected``: of
        racing processes exactly one wins, and a claim made before a crash is never made
        again for the same attempt. Clears the recorded addresses of the previous machine.
        ``events`` (the provisioner's ``domain.launch.started``) are appended by the same
        statement, only when the claim lands, stored with ``fleet_id`` (the domain's fleet;
        a claim whose ``fleet_id`` is not the domain's does not land), the domain and ``at``.

        Raises:
            ValueError: ``events`` without ``fleet_id``.
        """
        return await _provisioning.claim_launch(
            self._ex,
            domain_id,
            expected_attempt=expected_attempt,
            at=at,
            events=events,
            fleet_id=fleet_id,
        )

    @bounded
    async def mark_launched(
        self,
        domain_id: UUID,
        *,
        attempt: int,
        at: datetime,
        events: Sequence[EventPayload] = (),
        fleet_id: UUID | None = None,
    ) -> bool:
        """Record that launch ``attempt`` returned successfully (once).

        ``events`` (``domain.launch.succeeded``) ride the same statement as for
        :meth:`claim_launch`.

        Raises:
            ValueError: ``events`` without ``fleet_id``.
        """
        return await _provisioning.mark_launched(
            self._ex, domain_id, attempt=attempt, at=at, events=events, fleet_id=fleet_id
        )

    @bounded
    async def record_domain_address(
        self,
        domain_id: UUID,
        *,
        attempt: int,
        supervisor_url: str | None,
        serving_base_url: str,
        model_urls: Mapping[str, str],
        at: datetime,
        events: Sequence[EventPayload] = (),
        fleet_id: UUID | None = None,
    ) -> bool:
        """Record the supervisor, serving base and per-model URLs of launch ``attempt``.

        One statement, guarded on the domain still provisioning that attempt. Snapshots fill
        each binding's ``servingUrl`` from ``model_urls``. ``supervisor_url`` is None for a
        ``skyserve`` domain (its replicas run no supervisor). ``events``
        (``domain.address.recorded``) ride the same statement as for :meth:`claim_launch`.

        Raises:
            ValueError: ``events`` without ``fleet_id``.
        """
        return await _provisioning.record_domain_address(
            self._ex,
            domain_id,
            attempt=attempt,
            supervisor_url=supervisor_url,
            serving_base_url=serving_base_url,
            model_urls=model_urls,
            at=at,
            events=events,
            fleet_id=fleet_id,
        )

    @bounded
    async def escalate_domain_if_fleet_idle(
        self,
        *,
        domain_id: UUID,
        fleet_id: UUID,
        at: datetime,
        heartbeat_stale_ms: int,
        events: Sequence[EventPayload] = (),
    ) -> bool:
        """Fail a degraded active domain, only while a failover could follow (one statement).

        Guards, all in the same statement: the domain is degraded and the fleet's pointer
        targets it; the fleet has no in-flight operation; a viable standby exists (another
        domain of the fleet, ready, with a supervisor URL, seen at or after
        ``at - heartbeat_stale_ms``, with at least one inference slot and none failed).
        ``events`` (why it failed) are appended by the same statement, only when it lands.
        """
        return await _transitions.escalate_domain_if_fleet_idle(
            self._ex,
            domain_id=domain_id,
            fleet_id=fleet_id,
            at=at,
            heartbeat_stale_ms=heartbeat_stale_ms,
            events=events,
        )
