"""SQLAlchemy Core tables of DESIGN 5.2 (the schema the migrations build; nothing else).

These tables describe the migrated schema so that statements can be built against it and a
test can prove the migrations and these models never drift (``alembic compare_metadata``).
They are never used to create the schema: only the Alembic history does that.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from haru_protocol import (
    DomainState,
    InferenceSlotState,
    OperationKind,
    OperationState,
    OperationStep,
    Provider,
    SlotKind,
    TrainingSlotState,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Deterministic constraint names (Alembic batch operations on SQLite need named constraints)."""

PROMOTE_STEPS: tuple[OperationStep, ...] = (
    OperationStep.STOP_TRAINING,
    OperationStep.VERIFY_GPU,
    OperationStep.WAKE_VLLM,
    OperationStep.PROBE,
    OperationStep.SWITCH_ACTIVE,
    OperationStep.DEMOTE_OLD_SLEEP,
    OperationStep.DEMOTE_OLD_TRAIN,
)
DEMOTE_STEPS: tuple[OperationStep, ...] = (
    OperationStep.SLEEP_VLLM,
    OperationStep.START_TRAINING,
)
IN_FLIGHT_STATES: tuple[str, ...] = (OperationState.PENDING.value, OperationState.RUNNING.value)
FINISHED_STATES: tuple[str, ...] = (
    OperationState.SUCCEEDED.value,
    OperationState.FAILED.value,
    OperationState.CANCELLED.value,
)


class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware.

    A naive datetime is rejected: every state timestamp comes from the app clock and budgets
    compare against it, so an ambiguous value must never reach the database. SQLite has no
    timezone type; it stores the UTC wall time in SQLAlchemy's fixed-width text form, which
    sorts and compares correctly as text.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"timestamps must be timezone-aware: {value!r}")
        utc = value.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class SlugIsValid(sa.sql.expression.ColumnElement[bool]):
    """``column`` holds a DNS-label slug (DESIGN 3.1), as a CHECK expression for each engine.

    PostgreSQL gets the regular expression itself; SQLite has no regex operator, so the same
    language is spelled with GLOB (only ``[a-z0-9-]``, no leading, trailing or double hyphen).
    """

    inherit_cache = True
    _traverse_internals = [("column_name", InternalTraversal.dp_string)]  # noqa: RUF012
    type = sa.Boolean()

    def __init__(self, column_name: str) -> None:
        self.column_name = column_name


@compiles(SlugIsValid)
def _slug_check_sqlite(element: SlugIsValid, compiler: SQLCompiler, **kw: Any) -> str:
    c = element.column_name
    return (
        f"length({c}) BETWEEN 1 AND 63 AND {c} NOT GLOB '*[^a-z0-9-]*' "
        f"AND {c} NOT GLOB '-*' AND {c} NOT GLOB '*-' AND {c} NOT GLOB '*--*'"
    )


@compiles(SlugIsValid, "postgresql")
def _slug_check_postgresql(element: SlugIsValid, compiler: SQLCompiler, **kw: Any) -> str:
    c = element.column_name
    return f"length({c}) <= 63 AND {c} ~ '^[a-z0-9]+(-[a-z0-9]+)*$'"


def _in(column: str, values: Iterable[str]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


def _uuid() -> sa.Uuid[Any]:
    return sa.Uuid(as_uuid=True)


def _timestamps() -> list[sa.Column[Any]]:
    return [
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
    ]


metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

fleets = sa.Table(
    "fleets",
    metadata,
    sa.Column("id", _uuid(), primary_key=True),
    sa.Column("slug", sa.String(63), nullable=False),
    sa.Column("display_name", sa.Text(), nullable=True),
    sa.Column("active_domain_id", _uuid(), nullable=True),
    sa.Column("route_revision", sa.Integer(), nullable=False, server_default=sa.text("1")),
    sa.Column("policy", sa.JSON(), nullable=False),
    # The operation whose switch_active last moved the pointer. On SQLite a trigger reads it to
    # mark that operation routing_committed in the same statement (see the README).
    sa.Column("last_switch_operation_id", _uuid(), nullable=True),
    # The longest HARU_ROUTE_LEASE_MS a server process routes this fleet with (it only grows):
    # demote_old_sleep waits it out after the flip (migration 0006).
    sa.Column("route_lease_ms", sa.Integer(), nullable=True),
    # The fencing token: grows by one with every operation write of this fleet, in the same
    # statement (migration 0007); supervisors refuse state-changing calls with an older one.
    sa.Column("fence", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    # Revision of the operator's configuration (display name, policy; migration 0009):
    # `haru apply` swaps on it and raises it by one.
    sa.Column("config_revision", sa.Integer(), nullable=False, server_default=sa.text("1")),
    *_timestamps(),
    # The events an apply's write appends in its own statement (migration 0012).
    sa.Column("pending_events", sa.JSON(), nullable=True),
    sa.UniqueConstraint("slug"),
    sa.CheckConstraint(SlugIsValid("slug"), name="slug_format"),
    sa.CheckConstraint("route_revision > 0", name="route_revision_positive"),
    # The pointer may only target a domain of the same fleet. The cycle with domains.fleet_id
    # is why the migration adds this key after both tables exist (on PostgreSQL).
    sa.ForeignKeyConstraint(
        ["id", "active_domain_id"],
        ["domains.fleet_id", "domains.id"],
        use_alter=True,
    ),
)

domains = sa.Table(
    "domains",
    metadata,
    sa.Column("id", _uuid(), primary_key=True),
    sa.Column("fleet_id", _uuid(), sa.ForeignKey("fleets.id"), nullable=False),
    sa.Column("slug", sa.String(63), nullable=False),
    sa.Column(
        "state",
        sa.String(16),
        nullable=False,
        server_default=sa.text(repr(DomainState.PROVISIONING.value)),
    ),
    sa.Column("provider", sa.String(16), nullable=False),
    sa.Column("placement", sa.JSON(), nullable=False),
    sa.Column("supervisor_url", sa.Text(), nullable=True),
    sa.Column("serving_base_url", sa.Text(), nullable=True),
    sa.Column("last_seen_at", UtcDateTime(), nullable=True),
    sa.Column("state_updated_at", UtcDateTime(), nullable=False),
    *_timestamps(),
    # Provisioned domains (migration 0003): settings, launch claim, recorded addresses.
    sa.Column("provisioning", sa.JSON(), nullable=True),
    sa.Column("launch_attempt", sa.Integer(), nullable=False, server_default=sa.text("0")),
    sa.Column("launch_started_at", UtcDateTime(), nullable=True),
    sa.Column("launched_at", UtcDateTime(), nullable=True),
    sa.Column("model_urls", sa.JSON(), nullable=True),
    # Revision of the operator's configuration (URLs, placement, provisioning; migration
    # 0009): `haru apply` swaps on it and raises it by one.
    sa.Column("config_revision", sa.Integer(), nullable=False, server_default=sa.text("1")),
    # A proxy's latest refused connect to the domain (migration 0008).
    sa.Column("connect_failed_at", UtcDateTime(), nullable=True),
    # Removed by `haru apply` (migration 0012): kept for its events and operations, left out
    # of every read of the fleet; its slug may be added again.
    sa.Column("removed_at", UtcDateTime(), nullable=True),
    # The events an apply's write appends in its own statement (SQLite's triggers clear it).
    sa.Column("pending_events", sa.JSON(), nullable=True),
    sa.Index(
        "uq_domains_fleet_id_slug",
        "fleet_id",
        "slug",
        unique=True,
        postgresql_where=sa.text("removed_at IS NULL"),
        sqlite_where=sa.text("removed_at IS NULL"),
    ),
    # Target of the composite keys that keep pointers and operations inside their fleet.
    sa.UniqueConstraint("fleet_id", "id"),
    sa.CheckConstraint(SlugIsValid("slug"), name="slug_format"),
    sa.CheckConstraint(_in("state", (s.value for s in DomainState)), name="state_valid"),
    sa.CheckConstraint(_in("provider", (p.value for p in Provider)), name="provider_valid"),
)

slots = sa.Table(
    "slots",
    metadata,
    sa.Column("id", _uuid(), primary_key=True),
    sa.Column("domain_id", _uuid(), sa.ForeignKey("domains.id"), nullable=False),
    sa.Column("gpu_index", sa.Integer(), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("spec", sa.JSON(), nullable=False),
    sa.Column("state_updated_at", UtcDateTime(), nullable=False),
    *_timestamps(),
    # Revision of the spec (migration 0009): `haru apply` swaps on it and raises it by one.
    sa.Column("config_revision", sa.Integer(), nullable=False, server_default=sa.text("1")),
    # As on domains (migration 0012).
    sa.Column("removed_at", UtcDateTime(), nullable=True),
    sa.Column("pending_events", sa.JSON(), nullable=True),
    sa.Index(
        "uq_slots_domain_id_gpu_index_kind",
        "domain_id",
        "gpu_index",
        "kind",
        unique=True,
        postgresql_where=sa.text("removed_at IS NULL"),
        sqlite_where=sa.text("removed_at IS NULL"),
    ),
    sa.CheckConstraint("gpu_index >= 0", name="gpu_index_non_negative"),
    sa.CheckConstraint(_in("kind", (k.value for k in SlotKind)), name="kind_valid"),
    sa.CheckConstraint(
        f"(kind = 'inference' AND {_in('state', (s.value for s in InferenceSlotState))}) OR "
        f"(kind = 'training' AND {_in('state', (s.value for s in TrainingSlotState))})",
        name="state_valid_for_kind",
    ),
)

operations = sa.Table(
    "operations",
    metadata,
    sa.Column("id", _uuid(), primary_key=True),
    sa.Column("fleet_id", _uuid(), sa.ForeignKey("fleets.id"), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column(
        "state",
        sa.String(16),
        nullable=False,
        server_default=sa.text(repr(OperationState.PENDING.value)),
    ),
    sa.Column("target_domain_id", _uuid(), nullable=False),
    sa.Column("source_domain_id", _uuid(), nullable=True),
    sa.Column("current_step", sa.String(32), nullable=True),
    sa.Column("step_started_at", UtcDateTime(), nullable=True),
    sa.Column("error", sa.JSON(), nullable=True),
    sa.Column("routing_committed", sa.Boolean(), nullable=False, server_default=sa.false()),
    *_timestamps(),
    sa.Column("finished_at", UtcDateTime(), nullable=True),
    # Events an operation's insert or CAS appends, and slot states a CAS moves, in its own
    # statement. Only SQLite uses them: the triggers trg_operations_insert_events and
    # trg_operations_pending_writes apply them and clear the columns in that same statement,
    # so they are NULL between statements. PostgreSQL uses CTEs instead.
    sa.Column("pending_events", sa.JSON(), nullable=True),
    sa.Column("pending_mirrors", sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(["fleet_id", "target_domain_id"], ["domains.fleet_id", "domains.id"]),
    sa.ForeignKeyConstraint(["fleet_id", "source_domain_id"], ["domains.fleet_id", "domains.id"]),
    sa.CheckConstraint(_in("kind", (k.value for k in OperationKind)), name="kind_valid"),
    sa.CheckConstraint(_in("state", (s.value for s in OperationState)), name="state_valid"),
    sa.CheckConstraint(
        "current_step IS NULL OR "
        f"(kind = 'promote' AND {_in('current_step', (s.value for s in PROMOTE_STEPS))}) OR "
        f"(kind = 'demote' AND {_in('current_step', (s.value for s in DEMOTE_STEPS))})",
        name="step_valid_for_kind",
    ),
    sa.CheckConstraint("state <> 'running' OR current_step IS NOT NULL", name="running_has_step"),
    sa.CheckConstraint(
        f"({_in('state', IN_FLIGHT_STATES)} AND finished_at IS NULL) OR "
        f"({_in('state', FINISHED_STATES)} AND finished_at IS NOT NULL)",
        name="finished_at_iff_finished",
    ),
    # At most one in-flight operation per fleet (DESIGN 5.2); create_operation relies on it.
    sa.Index(
        "uq_operations_one_in_flight_per_fleet",
        "fleet_id",
        unique=True,
        postgresql_where=sa.text(_in("state", IN_FLIGHT_STATES)),
        sqlite_where=sa.text(_in("state", IN_FLIGHT_STATES)),
    ),
    # A fleet's recent operations (promotion backoff, pruning's ranking; migration 0013).
    sa.Index(None, "fleet_id", "created_at"),
)

events = sa.Table(
    "events",
    metadata,
    # INTEGER PRIMARY KEY AUTOINCREMENT on SQLite (a rowid alias that never reuses an id).
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("fleet_id", _uuid(), sa.ForeignKey("fleets.id"), nullable=False),
    sa.Column("domain_id", _uuid(), sa.ForeignKey("domains.id"), nullable=True),
    sa.Column("slot_id", _uuid(), sa.ForeignKey("slots.id"), nullable=True),
    sa.Column("operation_id", _uuid(), sa.ForeignKey("operations.id"), nullable=True),
    sa.Column("type", sa.String(128), nullable=False),
    sa.Column("payload", sa.JSON(), nullable=False),
    sa.Column("created_at", UtcDateTime(), nullable=False),
    sa.Index(None, "fleet_id", "id"),
    # The foreign key's check when a pruned operation is deleted (migration 0013).
    sa.Index(None, "operation_id"),
    sqlite_autoincrement=True,
)

# ---- per-fleet CA of provisioned domains (migration 0010) ----
fleet_cas = sa.Table(
    "fleet_cas",
    metadata,
    sa.Column("fleet_id", _uuid(), sa.ForeignKey("fleets.id"), primary_key=True),
    # PEM certificate of the fleet's CA (public: the server trusts it for the fleet's domains).
    sa.Column("cert_pem", sa.Text(), nullable=False),
    # The CA's PEM private key, sealed with the server's store key (never stored in clear).
    sa.Column("sealed_key", sa.Text(), nullable=False),
    sa.Column("created_at", UtcDateTime(), nullable=False),
)

domain_certs = sa.Table(
    "domain_certs",
    metadata,
    sa.Column("domain_id", _uuid(), sa.ForeignKey("domains.id"), primary_key=True),
    sa.Column("fleet_id", _uuid(), sa.ForeignKey("fleets.id"), nullable=False),
    # The launch attempt the certificate was issued for (a relaunch issues a fresh one).
    sa.Column("attempt", sa.Integer(), nullable=False),
    # The DNS name in the certificate; the server checks it (TLS SNI and name check).
    sa.Column("server_name", sa.Text(), nullable=False),
    # SHA-256 of the leaf certificate (DER), lower-case hex: what an operator may pin.
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("not_after", UtcDateTime(), nullable=False),
    sa.Column("issued_at", UtcDateTime(), nullable=False),
    sa.Index(None, "fleet_id"),
)

# ---- inference client keys (migration 0011) ----
client_keys = sa.Table(
    "client_keys",
    metadata,
    # The key's id: what access logs and metric labels name (never the key, never its name).
    sa.Column("id", _uuid(), primary_key=True),
    sa.Column("name", sa.Text(), nullable=False),
    # SHA-256 of the key, lower-case hex; the key itself is shown once and never stored.
    sa.Column("key_hash", sa.String(64), nullable=False),
    # Fleet ids (strings) the key may use; NULL: any fleet.
    sa.Column("fleets", sa.JSON(), nullable=True),
    # Model names the key may ask for; NULL: any model.
    sa.Column("models", sa.JSON(), nullable=True),
    # Requests per minute per server process; NULL: no limit.
    sa.Column("rpm", sa.Integer(), nullable=True),
    sa.Column("created_at", UtcDateTime(), nullable=False),
    sa.Column("revoked_at", UtcDateTime(), nullable=True),
    sa.UniqueConstraint("key_hash"),
)
