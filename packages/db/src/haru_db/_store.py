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

The methods are grouped: domain and slot state in :mod:`haru_db._store_state`, operations
and events in :mod:`haru_db._store_operations`, layout and configuration in
:mod:`haru_db._store_config`, the rest (certificates, client keys, reads, retention, health)
here; all run on the one executor of :mod:`haru_db._facade`.

Every public method runs under the store's client-side deadline (``call_timeout_s``): a
database that stalls makes the call fail with :class:`~haru_db.StateStoreUnavailableError`
within that bound instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import (
    DomainSnapshot,
    FleetRef,
    FleetRoutePointer,
    FleetSnapshot,
    Operation,
    OperationStep,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from haru_db import (
    _certs,
    _client_keys,
    _operations,
    _prune,
    _reads,
)
from haru_db._certs import DomainCert, StoredFleetCa
from haru_db._client_keys import ClientKey
from haru_db._engine import create_engine, translate_errors, writer
from haru_db._errors import StateStoreReadOnlyError
from haru_db._events import OperationEvent
from haru_db._exec import DEFAULT_CALL_TIMEOUT_S, Executor
from haru_db._facade import bounded
from haru_db._layout import LayoutApplyResult
from haru_db._mirrors import SlotMirror
from haru_db._prune import DEFAULT_PRUNE_BATCH, KEEP_RECENT_OPERATIONS, PruneCounts
from haru_db._store_config import ConfigWrites
from haru_db._store_operations import OperationWrites
from haru_db._store_state import StateWrites
from haru_db._urls import Dialect, redact_database_url, resolve_database_url

__all__ = (
    "LayoutApplyResult",
    "OperationEvent",
    "PruneCounts",
    "SlotMirror",
    "StateStore",
    "check_writable",
)


class StateStore(StateWrites, OperationWrites, ConfigWrites):
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

    # ---- per-fleet CA of provisioned domains ----------------------------------------------

    @bounded
    async def get_fleet_ca(self, fleet_id: UUID) -> StoredFleetCa | None:
        """The fleet's CA (certificate and sealed key), or None before its first launch."""
        return await _certs.get_fleet_ca(self._ex, fleet_id)

    @bounded
    async def create_fleet_ca(
        self, fleet_id: UUID, *, cert_pem: str, sealed_key: str, at: datetime
    ) -> StoredFleetCa:
        """Store a CA for the fleet unless it has one; the one stored (the first wins)."""
        return await _certs.create_fleet_ca(
            self._ex, fleet_id, cert_pem=cert_pem, sealed_key=sealed_key, at=at
        )

    @bounded
    async def record_domain_cert(self, cert: DomainCert) -> None:
        """Record the certificate issued to a domain, replacing the one of its last launch."""
        await _certs.record_domain_cert(self._ex, cert)

    @bounded
    async def list_domain_certs(self, fleet_id: UUID) -> list[DomainCert]:
        """The certificates last issued to the fleet's domains."""
        return await _certs.list_domain_certs(self._ex, fleet_id)

    # ---- inference client keys -----------------------------------------------------------

    @bounded
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

    @bounded
    async def list_client_keys(self) -> list[ClientKey]:
        """Every client key, revoked ones included, oldest first."""
        return await _client_keys.list_client_keys(self._ex)

    @bounded
    async def revoke_client_key(self, key_id: UUID, *, at: datetime) -> ClientKey | None:
        """Revoke a key (a second revocation keeps the first time); None: no such key."""
        return await _client_keys.revoke_client_key(self._ex, key_id, at=at)

    @bounded
    async def client_key_by_hash(self, key_hash: str) -> ClientKey | None:
        """The key whose SHA-256 is ``key_hash`` (revoked or not), or None."""
        return await _client_keys.client_key_by_hash(self._ex, key_hash)

    # ---- reads -----------------------------------------------------------------------------

    @bounded
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

    @bounded
    async def list_removed_teardowns(self, fleet_id: UUID) -> list[DomainSnapshot]:
        """The fleet's removed domains still ``stopping`` (their teardown has not finished)."""
        return await _reads.list_removed_teardowns(self._ex, fleet_id)

    @bounded
    async def get_fleet_route_pointer(self, ref: str | FleetRef) -> FleetRoutePointer | None:
        """The narrow routing read (id, slug, active domain, revision); ``ref`` as above."""
        return await _reads.get_fleet_route_pointer(self._ex, ref)

    @bounded
    async def get_route_lease_ms(self, fleet_id: UUID) -> int | None:
        """The fleet's stored route lease (:meth:`record_route_lease`), or None (none, no fleet)."""
        return await _reads.get_route_lease_ms(self._ex, fleet_id)

    @bounded
    async def list_fleets(self) -> list[FleetRoutePointer]:
        """Every fleet's routing pointer, ordered by slug (code point)."""
        return await _reads.list_fleets(self._ex)

    @bounded
    async def get_in_flight_operation(self, fleet_id: UUID) -> Operation | None:
        """The fleet's pending or running operation, if any."""
        return await _operations.get_in_flight_operation(self._ex, fleet_id)

    @bounded
    async def get_operation_fence(self, operation_id: UUID, step: OperationStep) -> int | None:
        """The fencing token of ``operation_id``'s ``step``: None unless it is running it.

        Every operation write (create, claim, advance, complete, fail) raises its fleet's
        fence by one in its own statement, so a process that read this token is behind as
        soon as the operation moves on; supervisors refuse its state-changing calls once they
        have seen a newer one (``X-Haru-Fence``).
        """
        return await _operations.get_operation_fence(self._ex, operation_id, step)

    @bounded
    async def list_recent_operations(
        self, fleet_id: UUID, *, limit: int = KEEP_RECENT_OPERATIONS
    ) -> list[Operation]:
        """The fleet's newest ``limit`` operations (newest first): input of promotion backoff.

        Pruning (:meth:`prune_history`) keeps the newest :data:`KEEP_RECENT_OPERATIONS` of each
        fleet: a larger ``limit`` may see fewer operations than were ever made.
        """
        return await _operations.list_recent_operations(self._ex, fleet_id, limit=limit)

    @bounded
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

    @bounded
    async def count_prunable(
        self, *, before: datetime, keep_recent: int = KEEP_RECENT_OPERATIONS
    ) -> PruneCounts:
        """What :meth:`prune_history` with the same arguments would delete now (a dry run)."""
        return await _prune.count_prunable(self._ex, before=before, keep_recent=keep_recent)

    @bounded
    async def ping(self) -> None:
        """Run ``SELECT 1``.

        Raises:
            StateStoreUnavailableError: The database cannot be reached.
        """
        await _reads.ping(self._ex)

    @bounded
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

    @bounded
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
