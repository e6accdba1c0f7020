"""Route pointer notifications: a pointer move NOTIFYs in its own transaction (PostgreSQL).

Revision ID: 0004
Revises: 0003
Create Date: 2025-01-02

Every UPDATE of a fleet row that changes ``route_revision`` (switch_active, the initial
pointer) calls ``pg_notify('haru_route', <pointer JSON>)`` from an AFTER UPDATE trigger, so the
notification is part of the compare-and-swap's transaction: it is delivered at commit, and
never for a statement that lost its race. Server processes LISTEN on the channel
(:mod:`haru_db._listen`) and update their route leases in milliseconds. The payload is the
pointer's wire shape (``id``, ``slug``, ``activeDomainId``, ``routeRevision``). SQLite has no
NOTIFY: nothing is created there (its processes rely on the lease polling alone).

Frozen history: this file imports no haru_db code.
"""

from __future__ import annotations

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

_FUNCTION = """
CREATE FUNCTION haru_notify_route() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(
        'haru_route',
        json_build_object(
            'id', NEW.id,
            'slug', NEW.slug,
            'activeDomainId', NEW.active_domain_id,
            'routeRevision', NEW.route_revision
        )::text
    );
    RETURN NULL;
END
$$
"""

_TRIGGER = """
CREATE TRIGGER trg_fleets_notify_route
AFTER UPDATE ON fleets
FOR EACH ROW
WHEN (NEW.route_revision IS DISTINCT FROM OLD.route_revision
      OR NEW.active_domain_id IS DISTINCT FROM OLD.active_domain_id)
EXECUTE FUNCTION haru_notify_route()
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_FUNCTION)
    op.execute(_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS trg_fleets_notify_route ON fleets")
    op.execute("DROP FUNCTION IF EXISTS haru_notify_route()")
