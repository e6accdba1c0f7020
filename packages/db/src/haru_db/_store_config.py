"""The state store's layout and configuration writes (part of :class:`~haru_db.StateStore`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Unpack
from uuid import UUID

from haru_protocol import (
    DomainLayout,
    EventPayload,
    FleetLayout,
    SlotSpec,
)

from haru_db import (
    _config,
    _layout,
)
from haru_db._config import ConfigWrite, SlotWrite
from haru_db._facade import Facade, bounded
from haru_db._layout import LayoutApplyResult, StoredPolicy


class ConfigWrites(Facade):
    """``haru apply``: layout apply, policy, and one-row configuration writes."""

    # ---- layout ----------------------------------------------------------------------------

    @bounded
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

    @bounded
    async def get_fleet_policy(self, fleet_id: UUID) -> StoredPolicy | None:
        """The fleet's stored policy patch with its version (None: no such fleet).

        Raises:
            MalformedFleetStateError: The stored policy is not a JSON object.
        """
        return await _layout.get_fleet_policy(self._ex, fleet_id)

    @bounded
    async def replace_fleet_policy(
        self,
        fleet_id: UUID,
        *,
        version: str,
        patch: Mapping[str, Any],
        at: datetime,
        events: Sequence[EventPayload] = (),
    ) -> bool:
        """Store ``patch`` as the fleet's policy patch, only while it is still at ``version``.

        One compare-and-swap statement on the fleet row, guarded by the stored document's
        exact text (:attr:`StoredPolicy.version`), that also appends ``events`` when it lands
        (never without them). False when another writer changed the policy first (read it
        again and retry) or the fleet is gone. ``patch`` is stored as given: validate it
        (:class:`haru_protocol.PolicyPatch`) first. The configuration revision moves; the
        route pointer does not.
        """
        return await _config.replace_fleet_policy(
            self._ex, fleet_id, version=version, patch=patch, at=at, events=events
        )

    # ---- configuration (haru apply) --------------------------------------------------------

    @bounded
    async def get_config_revisions(self, fleet_id: UUID) -> dict[tuple[str, UUID], int]:
        """The configuration revision of the fleet row and of each of its domains and slots.

        Keyed on ``("fleet" | "domain" | "slot", id)``; one statement. Read it before the
        snapshot a plan is made on: a change that lands in between then makes the plan's
        writes lose instead of applying a plan made on a newer view than its revisions.
        """
        return await _config.get_config_revisions(self._ex, fleet_id)

    @bounded
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

    @bounded
    async def update_domain_config(
        self,
        domain_id: UUID,
        *,
        layout: DomainLayout,
        moves_traffic: bool,
        **write: Unpack[ConfigWrite],
    ) -> int | None:
        """Set a domain's URLs, placement and provisioning settings from ``layout``.

        ``write``: ``fleet_id``, ``revision``, ``at`` and ``events``
        (:class:`~haru_db._config.ConfigWrite`). Lands only while the domain's revision is
        ``revision``, it is not removed and no in-flight operation drives it, and
        (``moves_traffic``) while it is not the fleet's active domain. State columns are left
        alone.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.update_domain_config(
            self._ex, domain_id, layout=layout, moves_traffic=moves_traffic, **write
        )

    @bounded
    async def remove_domain(self, domain_id: UUID, **write: Unpack[ConfigWrite]) -> int | None:
        """Remove a domain from its fleet (``removed_at``), with the guards of an update.

        ``write``: as for :meth:`update_domain_config`. Also lands only while the domain is not
        the fleet's active one. A provisioned domain in ``provisioning``, ``ready``,
        ``degraded`` or ``failed`` goes ``stopping`` in the same statement (the provisioner
        then tears it down, :meth:`list_removed_teardowns`). The row stays for its events and
        operations; reads of the fleet leave it out, and its slug can be added again. No
        operation can be created for it afterwards.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.remove_domain(self._ex, domain_id, **write)

    @bounded
    async def update_slot_spec(
        self, slot_id: UUID, *, spec: SlotSpec, **write: Unpack[SlotWrite]
    ) -> int | None:
        """Replace a slot's spec, with the guards of :meth:`update_domain_config`.

        ``write``: those of :meth:`update_domain_config`, with ``domain_id`` and
        ``moves_traffic`` (:class:`~haru_db._config.SlotWrite`).

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.update_slot_spec(self._ex, slot_id, spec=spec, **write)

    @bounded
    async def remove_slot(self, slot_id: UUID, **write: Unpack[SlotWrite]) -> int | None:
        """Remove a slot from its domain (``removed_at``), with the guards of an update.

        ``write``: as for :meth:`update_slot_spec`.

        Returns:
            The new revision, or None when a guard failed.
        """
        return await _config.remove_slot(self._ex, slot_id, **write)

    @bounded
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

    @bounded
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
