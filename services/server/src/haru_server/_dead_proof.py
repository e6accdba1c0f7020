"""This process's memory of the evidence that a domain is dead (DESIGN 7.3, detection).

Each heartbeat round hands it what every domain answered; it follows, per domain, the unbroken
run of observations proving the domain dead (its supervisor answers that the models refuse, or
the host refuses every connect), events the first proof and the end of a run, counts weak
evidence, and notices a proxy's refused connect to the active. The failover decisions
(:mod:`haru_server._failover_decisions`) read the runs to confirm a death; the rules themselves
are :mod:`haru_core`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING
from uuid import UUID

from haru_core import (
    Reach,
    active_proven_dead,
    check_endpoints,
    dead_since,
    host_unreachable,
    inference_bindings,
    proxy_connect_failed,
    proxy_kick,
    serving_endpoints,
    weak_evidence,
)
from haru_protocol import (
    DeadEvidence,
    DomainDeadCleared,
    DomainDeadSuspected,
    DomainSnapshot,
    FleetSnapshot,
    SupervisorStatus,
)

from haru_server._logfields import log_fields
from haru_server._reach import ENDPOINT_CONNECT_TIMEOUT_S, connect_reach
from haru_server._reconcile_context import ReconcileContext

if TYPE_CHECKING:
    from haru_server._heartbeat_round import Answer

logger = logging.getLogger(__name__)

PROXY_EVIDENCE_WINDOW_MS = 10_000
"""A proxy's refused connect (``connectFailedAt``) this recent corroborates and kicks."""


@dataclass(frozen=True, slots=True)
class DeadProof:
    """This process's unbroken run of observations proving the active dead."""

    since: datetime
    models: tuple[str, ...]
    evidence: DeadEvidence


class DeadProofs:
    """Per domain, the run of heartbeats proving it dead, as this process saw them.

    Args:
        ctx: The reconciler's store, metrics and tuning.
    """

    def __init__(self, ctx: ReconcileContext) -> None:
        self._ctx = ctx
        # Per active domain: since when, and which models, this process's heartbeats have
        # proven it dead without a break (haru_core.dead_since).
        self._dead: dict[UUID, DeadProof] = {}
        # Per domain, the newest proxy connectFailedAt this process acted on (a kick).
        self._proxy_seen: dict[UUID, datetime] = {}
        # Per active domain, the weak evidence its latest round showed (logged on change).
        self._weak: dict[UUID, str] = {}

    def proof_of(self, domain_id: UUID | None) -> DeadProof | None:
        """The run of observations proving ``domain_id`` dead, if one is unbroken."""
        return None if domain_id is None else self._dead.get(domain_id)

    def forget(self, domain_id: UUID) -> None:
        """Drop ``domain_id``'s run (its death was confirmed and written)."""
        self._dead.pop(domain_id, None)

    async def note_round(
        self,
        fleet: FleetSnapshot,
        answers: dict[UUID, Answer],
        reached: list[UUID],
        reaches: Mapping[UUID, Reach],
        now: datetime,
    ) -> None:
        """Follow the run of observations proving the active dead (and count weak evidence).

        Any other observation ends it, and so does none (a poll still running this round): the
        confirmation needs a fresh proof, never an old one. The first proof is evented
        (``domain.dead_suspected``), and so is a run that ends before it failed the active
        (``domain.dead_cleared``). ``answers``: this round's answer per domain; ``reached``:
        the domains that answered; ``reaches``: how each domain's latest poll's connection
        ended.
        """
        for domain in fleet.domains:
            previous = self._dead.get(domain.id)
            if domain.supervisor_url is None or domain.id not in answers:
                # Not polled, or its poll is still running: no fresh observation.
                if previous is not None:
                    await self._clear(fleet, domain, previous, now)
                continue
            answer = answers[domain.id]
            models, evidence, endpoints, supervisor = await self._examine(
                fleet, domain, answer, reached, reaches
            )
            proxy_failed = proxy_connect_failed(domain, now=now, window_ms=PROXY_EVIDENCE_WINDOW_MS)
            self._note_weak(
                fleet,
                domain,
                weak_evidence(
                    fleet,
                    domain,
                    status=answer if isinstance(answer, SupervisorStatus) else None,
                    supervisor=supervisor,
                    proxy_failed=proxy_failed,
                    proven=evidence is not None,
                ),
            )
            since = dead_since(
                None if previous is None else previous.since, proven=evidence is not None, now=now
            )
            if since is None or evidence is None:
                if previous is not None:
                    await self._clear(fleet, domain, previous, now)
                continue
            self._dead[domain.id] = DeadProof(since, models, evidence)
            if previous is not None:
                continue
            logger.warning(
                "domain %s: proven dead (%s: %s); confirming in %d ms",
                domain.slug,
                evidence,
                ", ".join(models),
                fleet.policy.dead_confirm_ms,
                extra=log_fields(fleet, domain=domain),
            )
            self._ctx.metrics.dead_evidence(fleet.slug, evidence, "suspected")
            await self._ctx.store.append_event(
                fleet_id=fleet.id,
                payload=DomainDeadSuspected(
                    evidence=evidence,
                    models=models,
                    endpoints=endpoints,
                    proxy_connect_failed_at=domain.connect_failed_at if proxy_failed else None,
                    dead_confirm_ms=fleet.policy.dead_confirm_ms,
                ),
                at=now,
                domain_id=domain.id,
            )

    async def _clear(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, proof: DeadProof, now: datetime
    ) -> None:
        self._dead.pop(domain.id, None)
        logger.info(
            "domain %s: no longer proven dead",
            domain.slug,
            extra=log_fields(fleet, domain=domain),
        )
        self._ctx.metrics.dead_evidence(fleet.slug, proof.evidence, "cleared")
        await self._ctx.store.append_event(
            fleet_id=fleet.id,
            payload=DomainDeadCleared(evidence=proof.evidence, suspected_at=proof.since),
            at=now,
            domain_id=domain.id,
        )

    def _note_weak(self, fleet: FleetSnapshot, domain: DomainSnapshot, kind: str | None) -> None:
        """Count weak evidence against the active (visible, never a fast failover)."""
        if kind is None:
            self._weak.pop(domain.id, None)
            return
        self._ctx.metrics.weak(fleet.slug, kind)
        if self._weak.get(domain.id) != kind:
            self._weak[domain.id] = kind
            logger.info(
                "active domain %s: weak evidence (%s): the grace (%d ms) and the staleness "
                "(%d ms) decide",
                domain.slug,
                kind,
                fleet.policy.degraded_grace_ms,
                fleet.policy.heartbeat_stale_ms,
                extra=log_fields(fleet, domain=domain),
            )

    async def _examine(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        answer: Answer,
        reached: list[UUID],
        reaches: Mapping[UUID, Reach],
    ) -> tuple[tuple[str, ...], DeadEvidence | None, int, Reach | None]:
        """One observation of ``domain``: the proven-dead models, the evidence, endpoints."""
        status = answer if isinstance(answer, SupervisorStatus) else None
        if status is not None:
            models = active_proven_dead(fleet, domain, status)
            return models, ("models_refused" if models else None), 0, Reach.ANSWERED
        supervisor = None if answer is not None else reaches.get(domain.id)
        if not check_endpoints(fleet, domain, supervisor=supervisor, reached=reached):
            return (), None, 0, supervisor
        endpoints = await self._endpoints(domain)
        if host_unreachable(
            fleet, domain, supervisor=supervisor, endpoints=endpoints, reached=reached
        ):
            names = tuple(dict.fromkeys(b.name for b in inference_bindings(domain)))
            return names, "host_unreachable", len(endpoints), supervisor
        logger.info(
            "domain %s: supervisor %s but a serving endpoint does not (%s): weak evidence",
            domain.slug,
            None if supervisor is None else supervisor.value,
            ", ".join(f"{h}:{p} {r.value}" for (h, p), r in endpoints.items()),
            extra=log_fields(fleet, domain=domain),
        )
        return (), None, 0, supervisor

    async def _endpoints(self, domain: DomainSnapshot) -> dict[tuple[str, int], Reach]:
        """How a bounded connect to each serving endpoint of ``domain`` ended (concurrently)."""
        links = serving_endpoints(domain)
        reaches = await asyncio.gather(
            *(connect_reach(h, p, timeout_s=ENDPOINT_CONNECT_TIMEOUT_S) for h, p in links)
        )
        return dict(zip(links, reaches, strict=True))

    def proxy_kicked(self, fleet: FleetSnapshot, now: datetime) -> bool:
        """Whether a proxy recorded a refused connect to the active, new to this process.

        Then the loop comes back at once for a fresh heartbeat (never a failover by itself).
        """
        active = fleet.active_domain
        if active is None or active.connect_failed_at is None:
            return False
        seen = self._proxy_seen.get(active.id)
        if not proxy_kick(active, seen=seen, now=now, window_ms=PROXY_EVIDENCE_WINDOW_MS):
            return False
        self._proxy_seen[active.id] = active.connect_failed_at
        logger.info(
            "fleet %s: a proxy could not connect to active domain %s at %s; heartbeat again now",
            fleet.slug,
            active.slug,
            active.connect_failed_at.isoformat(),
            extra=log_fields(fleet, domain=active),
        )
        return True
