"""The heartbeat round (DESIGN 7.3): every supervisor polled, and what this process saw of each.

One round per tick polls every domain's supervisor concurrently, waits a bounded time, mirrors
slot health, records the heartbeats in one statement and judges each domain's state. Between
ticks it keeps this process's memory of the round: each domain's latest answer and error, a
refused token, polls that outlived their round (a hung supervisor), whether the fleet looked
cut off, and how each connection ended (handed to :class:`~haru_server._dead_proof.DeadProofs`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from haru_core import (
    DomainChange,
    Reach,
    domain_change_on_heartbeat,
    domain_role,
    server_partitioned,
    slot_health_changes,
)
from haru_protocol import (
    DomainHeartbeatFailed,
    DomainNotReady,
    DomainSnapshot,
    DomainStateChanged,
    DomainSupervisorAuthorized,
    DomainSupervisorUnauthorized,
    EventType,
    FleetSnapshot,
    Operation,
    ServerPartitioned,
    ServerPartitionHealed,
    SlotStateChanged,
    SupervisorStatus,
)
from haru_supervisor_client import SupervisorCallError, SupervisorUnauthorizedError

from haru_server._dead_proof import DeadProofs
from haru_server._logfields import log_fields
from haru_server._reach import reach_of_call_error
from haru_server._reconcile_context import ReconcileContext

logger = logging.getLogger(__name__)

AUTH_LOG_INTERVAL_S = 60.0
"""While a supervisor keeps refusing the server's token, repeat the ERROR line this often."""


@dataclass(frozen=True, slots=True)
class _Refused:
    """A heartbeat the supervisor answered 401/403: the token is wrong, the domain unjudged."""

    message: str


Answer = SupervisorStatus | _Refused | None
"""A domain's answer to one heartbeat poll (None: it did not answer)."""


@dataclass(slots=True)
class _PollInFlight:
    """A heartbeat poll of one domain, which may outlive the tick that started it."""

    fleet_id: UUID
    url: str
    task: asyncio.Task[Answer]


class HeartbeatRound:
    """Runs heartbeat rounds and remembers, per domain, what this process's latest one saw.

    Args:
        ctx: The reconciler's store, client, clock, tuning and metrics.
        dead_proofs: Told every round's answers (the runs of proof that the active is dead).
    """

    def __init__(self, ctx: ReconcileContext, dead_proofs: DeadProofs) -> None:
        self._ctx = ctx
        self._dead_proofs = dead_proofs
        self._heartbeat_errors: dict[UUID, str] = {}
        self._auth_failing: dict[UUID, str] = {}
        self._auth_logged_at: dict[UUID, float] = {}
        # Each domain's answer to this process's latest heartbeat (None: it did not answer).
        self._heartbeat_answers: dict[UUID, SupervisorStatus | None] = {}
        self._polls: dict[UUID, _PollInFlight] = {}
        # Domains whose latest poll outlived its round: no tick waits for their polls.
        self._suspects: set[UUID] = set()
        # Fleets whose latest heartbeat round reached no supervisor at all.
        self._partitioned: set[UUID] = set()
        # How each domain's latest finished heartbeat poll ended (its connection).
        self._reach: dict[UUID, Reach] = {}
        # When each domain's latest answering poll finished, on the application clock: an
        # answer a later tick takes is recorded at this time, not at that tick's.
        self._answered_at: dict[UUID, datetime] = {}

    async def close(self) -> None:
        """Cancel the heartbeat polls still running (a hung supervisor's)."""
        polls = [p.task for p in self._polls.values()]
        self._polls.clear()
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)

    def is_partitioned(self, fleet_id: UUID) -> bool:
        """Whether the latest round of ``fleet_id`` reached no supervisor at all."""
        return fleet_id in self._partitioned

    def is_suspect(self, domain_id: UUID) -> bool:
        """Whether ``domain_id``'s latest poll outlived its round (a hung supervisor?)."""
        return domain_id in self._suspects

    def latest_answer(self, domain_id: UUID) -> SupervisorStatus | None:
        """``domain_id``'s status in this process's latest heartbeat (None: no answer)."""
        return self._heartbeat_answers.get(domain_id)

    def auth_failing(self, domain_id: UUID) -> bool:
        """Whether ``domain_id``'s supervisor refuses the server's token."""
        return domain_id in self._auth_failing

    def last_error(self, domain_id: UUID) -> str | None:
        """Why this process's latest heartbeat of ``domain_id`` failed (None: it answered)."""
        return self._heartbeat_errors.get(domain_id)

    async def run(
        self, fleet: FleetSnapshot, in_flight: Operation | None
    ) -> tuple[FleetSnapshot, frozenset[UUID]]:
        """Poll every supervisor once and record what they answered.

        Returns the fleet as it stands afterwards and the ids of the domains that answered.
        """
        # A domain without a supervisor URL has nothing to poll (nothing could drive it).
        polled = [(d, d.supervisor_url) for d in fleet.domains if d.supervisor_url is not None]
        if not polled:
            return fleet, frozenset()
        # The domains an in-flight operation drives: their in-between slot states are its own.
        busy = (
            set()
            if in_flight is None
            else {in_flight.target_domain_id, in_flight.source_domain_id} - {None}
        )
        answers, late = await self._collect_answers(fleet, polled)
        now = self._ctx.clock()
        # When each answer came: now for this round's, its own time for a poll an earlier
        # tick left running (a slow supervisor), never after now.
        seen_at = {domain_id: min(at, now) for domain_id, at in late.items()}
        reached = [d.id for d, answer in answers if answer is not None]
        partitioned = await self._note_partition(
            fleet, polled=[d.id for d, _ in polled], reached=reached, now=now
        )
        await self._dead_proofs.note_round(
            fleet, {d.id: a for d, a in answers}, reached, self._reach, now
        )
        landed = False
        verdicts: list[tuple[DomainSnapshot, SupervisorStatus | None, bool]] = []
        for domain, answer in answers:
            refused = answer if isinstance(answer, _Refused) else None
            await self._auth_verdict(fleet, domain, refused, now)
            status = answer if isinstance(answer, SupervisorStatus) else None
            self._heartbeat_answers[domain.id] = status
            if status is None:
                reason = "unauthorized" if refused is not None else "unreachable"
                self._ctx.metrics.heartbeat_failed(fleet.slug, domain.slug, reason=reason)
            else:
                landed |= await self._mirror_slots(
                    fleet, domain, status, now, busy=domain.id in busy
                )
            verdicts.append((domain, status, refused is not None))
        # Slot health first, then the heartbeats (DESIGN 7.3): every domain answering in this
        # round in one statement, a late answer in one of its own at its own time.
        read = {d.id: d.last_seen_at for d, status, _ in verdicts if status is not None}
        answered = frozenset(read)
        seen, replaced = await self._record_heartbeats(read, seen_at, now)
        for domain, status, _ in verdicts:
            if status is not None:
                # The duty cycle counts the interval this write replaced, if it did (one
                # replica per interval).
                self._ctx.metrics.heartbeat_answered(
                    fleet,
                    domain,
                    status,
                    seen_at.get(domain.id, now),
                    replaced=domain.last_seen_at if domain.id in replaced else None,
                )
        if len(seen) < len(answered):
            # A newer heartbeat (another process, a clock ahead) is stored: judging staleness
            # from this snapshot's older value would be wrong. Re-read.
            landed = True
        for domain, status, unauthorized in verdicts:
            if partitioned and status is None:
                continue  # this server's network, not the domain's: left as it was
            landed |= await self._judge_domain(
                fleet, domain, status, now, unauthorized=unauthorized
            )
        if landed:
            return await self._ctx.load_fleet(str(fleet.id)), answered
        if not seen:
            return fleet, answered
        domains = tuple(
            d.model_copy(update={"last_seen_at": seen_at.get(d.id, now)}) if d.id in seen else d
            for d in fleet.domains
        )
        return fleet.model_copy(update={"domains": domains}), answered

    async def _record_heartbeats(
        self, read: dict[UUID, datetime | None], seen_at: dict[UUID, datetime], now: datetime
    ) -> tuple[frozenset[UUID], frozenset[UUID]]:
        """Record ``read``'s heartbeats, each at its ``seen_at`` time or else ``now``."""
        seen: set[UUID] = set()
        replaced: set[UUID] = set()
        groups: dict[datetime, dict[UUID, datetime | None]] = {}
        for domain_id, last in read.items():
            groups.setdefault(seen_at.get(domain_id, now), {})[domain_id] = last
        for at, group in groups.items():
            recorded, moved = await self._ctx.store.record_heartbeats(group, at=at)
            seen |= recorded
            replaced |= moved
        return frozenset(seen), frozenset(replaced)

    async def _poll(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, url: str
    ) -> SupervisorStatus | _Refused | None:
        try:
            status = await self._ctx.client.status(
                url, timeout_s=self._ctx.options.heartbeat_timeout_s
            )
        except SupervisorUnauthorizedError as exc:
            self._reach[domain.id] = Reach.ANSWERED
            self._heartbeat_errors[domain.id] = str(exc)
            return _Refused(str(exc))
        except SupervisorCallError as exc:
            self._reach[domain.id] = reach_of_call_error(exc)
            message = str(exc)
            if self._heartbeat_errors.get(domain.id) != message:
                self._heartbeat_errors[domain.id] = message
                logger.warning(
                    "heartbeat of domain %s failed: %s",
                    domain.slug,
                    message,
                    extra=log_fields(fleet, domain=domain),
                )
            return None
        self._reach[domain.id] = Reach.ANSWERED
        self._answered_at[domain.id] = self._ctx.clock()
        if self._heartbeat_errors.pop(domain.id, None) is not None:
            logger.info(
                "heartbeat of domain %s answers again",
                domain.slug,
                extra=log_fields(fleet, domain=domain),
            )
        return status

    async def _auth_verdict(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, refused: _Refused | None, now: datetime
    ) -> None:
        """Report a supervisor refusing the token loudly, and its recovery once."""
        if refused is None:
            if self._auth_failing.pop(domain.id, None) is None:
                return
            self._auth_logged_at.pop(domain.id, None)
            logger.warning(
                "supervisor of domain %s accepts the server's token again",
                domain.slug,
                extra=log_fields(fleet, domain=domain),
            )
            await self._ctx.store.append_event(
                fleet_id=fleet.id,
                payload=DomainSupervisorAuthorized(),
                at=now,
                domain_id=domain.id,
            )
            return
        first = domain.id not in self._auth_failing
        self._auth_failing[domain.id] = refused.message
        mono = time.monotonic()
        last = self._auth_logged_at.get(domain.id)
        if first or last is None or mono - last >= AUTH_LOG_INTERVAL_S:
            self._auth_logged_at[domain.id] = mono
            logger.error(
                "supervisor of domain %s (fleet %s) refuses the server's token: %s. This is a "
                "configuration error (HARU_SUPERVISOR_TOKEN differs from the supervisor's); "
                "the domain is NOT judged down and nothing fails over because of it",
                domain.slug,
                fleet.slug,
                refused.message,
                extra=log_fields(fleet, domain=domain),
            )
        if first:
            await self._ctx.store.append_event(
                fleet_id=fleet.id,
                payload=DomainSupervisorUnauthorized(
                    message=refused.message, role=domain_role(fleet, domain)
                ),
                at=now,
                domain_id=domain.id,
            )

    async def _note_partition(
        self, fleet: FleetSnapshot, *, polled: list[UUID], reached: list[UUID], now: datetime
    ) -> bool:
        """Record whether this round reached no supervisor of ``fleet`` (evented on change).

        While it reaches none, this process judges no domain and fails nothing over: its own
        network and every domain lost at once look the same from here. The gauge
        ``haru_reconcile_partitioned`` and a ``server.partitioned`` event (when the store is
        reachable) say so; ``server.partition.healed`` when a supervisor answers again.
        """
        partitioned = server_partitioned(polled, reached)
        self._ctx.metrics.partitioned(fleet.slug, cut_off=partitioned)
        payload: ServerPartitioned | ServerPartitionHealed
        if partitioned and fleet.id not in self._partitioned:
            self._partitioned.add(fleet.id)
            logger.warning(
                "fleet %s: no supervisor answered this server's heartbeats (%d domains); this "
                "server may be cut off from the network: no domain is judged and nothing fails "
                "over until one answers again",
                fleet.slug,
                len(polled),
                extra=log_fields(fleet),
            )
            payload = ServerPartitioned(
                domains=len(polled), host=socket.gethostname(), pid=os.getpid()
            )
        elif not partitioned and fleet.id in self._partitioned:
            self._partitioned.discard(fleet.id)
            logger.info(
                "fleet %s: supervisors answer this server again",
                fleet.slug,
                extra=log_fields(fleet),
            )
            payload = ServerPartitionHealed(host=socket.gethostname(), pid=os.getpid())
        else:
            return partitioned
        await self._ctx.store.append_event(fleet_id=fleet.id, payload=payload, at=now)
        return partitioned

    def _left_running(self, fleet: FleetSnapshot, polling: set[UUID]) -> dict[UUID, Answer]:
        """The answers of the polls earlier ticks of ``fleet`` left running that are done now.

        Drops those done and those of domains not polled any more (cancelled).
        """
        earlier: dict[UUID, Answer] = {}
        for domain_id, left in list(self._polls.items()):
            if left.fleet_id != fleet.id:
                continue
            if domain_id not in polling:
                # A domain that left the fleet, or has no supervisor URL any more.
                left.task.cancel()
                del self._polls[domain_id]
                self._suspects.discard(domain_id)
                self._answered_at.pop(domain_id, None)
            elif left.task.done():
                del self._polls[domain_id]
                if not left.task.cancelled():
                    earlier[domain_id] = left.task.result()
                    if earlier[domain_id] is not None:
                        self._suspects.discard(domain_id)  # it answers again: wait for it
        return earlier

    async def _collect_answers(
        self, fleet: FleetSnapshot, polled: list[tuple[DomainSnapshot, str]]
    ) -> tuple[list[tuple[DomainSnapshot, Answer]], dict[UUID, datetime]]:
        """Each domain's heartbeat answer that is in, after waiting a bounded round.

        A domain gets a new poll unless one is still running; the tick waits for its new
        polls up to ``heartbeat_round_s``, never for older ones nor for a suspect's (a domain
        whose latest poll outlived its round), so calls to different domains never wait for
        each other beyond that. A domain whose poll is still running is left out (unjudged
        this tick: neither seen nor failed); the answer of a poll an earlier tick left
        running (or its failure once the poll's own bound ran out) is taken by the first
        tick that finds it done, unless that tick's new poll answers in its round.

        Returns the answers, and when each status taken from an earlier tick's poll came.
        """
        earlier = self._left_running(fleet, {d.id for d, _ in polled})
        started: list[asyncio.Task[Answer]] = []
        for domain, url in polled:
            poll = self._polls.get(domain.id)
            if poll is not None and poll.url != url:
                poll.task.cancel()  # the supervisor moved (a relaunch): poll the new address
                poll = None
            if poll is None:
                task = asyncio.create_task(self._poll(fleet, domain, url))
                self._polls[domain.id] = _PollInFlight(fleet.id, url, task)
                if domain.id not in self._suspects:
                    started.append(task)
        if started:
            await asyncio.wait(started, timeout=self._ctx.options.heartbeat_round_s)
        answers: list[tuple[DomainSnapshot, Answer]] = []
        late: dict[UUID, datetime] = {}
        for domain, _ in polled:
            task = self._polls[domain.id].task
            if task.done():
                del self._polls[domain.id]
                answer = None if task.cancelled() else task.result()
                answers.append((domain, answer))
                if answer is not None:
                    self._suspects.discard(domain.id)  # it answers within a round again
                continue
            self._suspects.add(domain.id)
            if domain.id in earlier:
                answer = earlier[domain.id]
                answers.append((domain, answer))
                at = self._answered_at.get(domain.id)
                if isinstance(answer, SupervisorStatus) and at is not None:
                    late[domain.id] = at
        return answers, late

    async def _mirror_slots(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus,
        now: datetime,
        *,
        busy: bool,
    ) -> bool:
        landed = False
        # One CAS per slot: one dead GPU must not drag its siblings.
        for change in slot_health_changes(fleet, domain, status, busy=busy):
            moved = await self._ctx.store.transition_slot(
                change.slot_id,
                kind=change.kind,
                from_states=(change.from_state,),
                to=change.to_state,
                at=now,
                events=(
                    SlotStateChanged(
                        kind=change.kind,
                        from_state=change.from_state.value,
                        to_state=change.to_state.value,
                        cause="heartbeat",
                    ),
                ),
                fleet_id=fleet.id,
                domain_id=domain.id,
            )
            landed = landed or moved
        return landed

    async def _judge_domain(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus | None,
        now: datetime,
        *,
        unauthorized: bool,
    ) -> bool:
        change = domain_change_on_heartbeat(fleet, domain, status, unauthorized=unauthorized)
        if change is None:
            return False
        moved = await self._ctx.store.transition_domain(
            domain.id,
            from_states=(change.from_state,),
            to=change.to_state,
            at=now,
            events=(_domain_change_payload(change),),
            fleet_id=fleet.id,
        )
        if moved:
            logger.info(
                "domain %s: %s -> %s",
                domain.slug,
                change.from_state.value,
                change.to_state.value,
                extra=log_fields(fleet, domain=domain),
            )
        return moved


def _domain_change_payload(
    change: DomainChange,
) -> DomainStateChanged | DomainNotReady | DomainHeartbeatFailed:
    model: type[DomainStateChanged | DomainNotReady | DomainHeartbeatFailed]
    if change.event is EventType.DOMAIN_NOT_READY:
        model = DomainNotReady
    elif change.event is EventType.DOMAIN_HEARTBEAT_FAILED:
        model = DomainHeartbeatFailed
    else:
        model = DomainStateChanged
    verdict = change.detail
    return model(
        from_state=change.from_state,
        to_state=change.to_state,
        role=verdict.role,
        reachable=verdict.reachable,
        supervisor_ready=verdict.supervisor_ready,
        active_ready=verdict.active_ready,
        models_not_awake=verdict.models_not_awake,
    )
