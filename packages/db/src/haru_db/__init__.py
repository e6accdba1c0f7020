"""Haru's state store: schema, Alembic migrations and the compare-and-swap repository.

One URL picks the engine: PostgreSQL (psycopg 3) in production, an embedded SQLite file by
default. Every write is one guarded statement that reports whether it won (DESIGN 5.3); reads
return haru_protocol read models. The pytest plugin :mod:`haru_db.testing` gives other
packages a freshly migrated database per test on both engines.
"""

from haru_db._backup import BackupResult, backup_sqlite, sqlite_file
from haru_db._certs import DomainCert, StoredFleetCa
from haru_db._client_keys import ClientKey
from haru_db._errors import (
    BackupError,
    ConstraintViolationError,
    DomainRemovedError,
    HaruDbError,
    LayoutFileError,
    MalformedFleetStateError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StateStoreReadOnlyError,
    StateStoreUnavailableError,
)
from haru_db._events import OperationEvent
from haru_db._exec import DEFAULT_CALL_TIMEOUT_S
from haru_db._layout import LayoutApplyResult, StoredPolicy
from haru_db._listen import ROUTE_CHANNEL, RouteListener
from haru_db._migrate import (
    SCHEMA_RELEASES,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from haru_db._mirrors import SlotMirror
from haru_db._operator import load_layout_file, seed_layout_file
from haru_db._prune import (
    DEFAULT_PRUNE_BATCH,
    KEEP_RECENT_OPERATIONS,
    RELAUNCH_STREAK_EVENTS,
    PruneCounts,
)
from haru_db._store import StateStore, check_writable
from haru_db._urls import DEFAULT_DATABASE_FILE, redact_database_url, resolve_database_url

__all__ = (
    # URLs and settings
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_DATABASE_FILE",
    # Retention
    "DEFAULT_PRUNE_BATCH",
    "KEEP_RECENT_OPERATIONS",
    "RELAUNCH_STREAK_EVENTS",
    # Route notifications
    "ROUTE_CHANNEL",
    # Schema releases
    "SCHEMA_RELEASES",
    # Errors
    "BackupError",
    "BackupResult",
    "ClientKey",
    "ConstraintViolationError",
    "DomainCert",
    "DomainRemovedError",
    "HaruDbError",
    # Repository
    "LayoutApplyResult",
    "LayoutFileError",
    "MalformedFleetStateError",
    "OperationEvent",
    "PruneCounts",
    "RouteListener",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "SlotMirror",
    "StateStore",
    "StateStoreReadOnlyError",
    "StateStoreUnavailableError",
    "StoredFleetCa",
    "StoredPolicy",
    # Migrations, backups and operator helpers (the haru CLI)
    "backup_sqlite",
    "check_schema",
    "check_writable",
    "current_revision",
    "downgrade",
    "head_revision",
    "load_layout_file",
    "redact_database_url",
    "resolve_database_url",
    "seed_layout_file",
    "sqlite_file",
    "upgrade",
)
