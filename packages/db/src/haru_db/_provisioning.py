"""Provisioned domains: the launch claim and the recorded address (one guarded UPDATE each).

Each write can carry events about the launch: they ride its statement and land only with it
(DESIGN 5.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import DomainState, EventPayload

from haru_db._event_writes import about_row, write_domain
from haru_db._exec import Executor, aware
from haru_db._tables import domains

_PROVISIONING = DomainState.PROVISIONING.value


async def claim_launch(
    ex: Executor,
    domain_id: UUID,
    *,
    expected_attempt: int,
    at: datetime,
    events: Sequence[EventPayload] = (),
    fleet_id: UUID | None = None,
) -> bool:
    at = aware(at)
    about = about_row(events, at, fleet_id, domain_id)
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            domains.c.state == _PROVISIONING,
            domains.c.launch_attempt == expected_attempt,
        )
        .values(
            launch_attempt=expected_attempt + 1,
            launch_started_at=at,
            launched_at=None,
            supervisor_url=None,
            serving_base_url=None,
            model_urls=None,
            updated_at=at,
        )
    )
    return await write_domain(ex, stmt, about)


async def mark_launched(
    ex: Executor,
    domain_id: UUID,
    *,
    attempt: int,
    at: datetime,
    events: Sequence[EventPayload] = (),
    fleet_id: UUID | None = None,
) -> bool:
    at = aware(at)
    about = about_row(events, at, fleet_id, domain_id)
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            domains.c.launch_attempt == attempt,
            domains.c.launched_at.is_(None),
        )
        .values(launched_at=at, updated_at=at)
    )
    return await write_domain(ex, stmt, about)


async def record_domain_address(
    ex: Executor,
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
    at = aware(at)
    about = about_row(events, at, fleet_id, domain_id)
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            domains.c.state == _PROVISIONING,
            domains.c.launch_attempt == attempt,
        )
        .values(
            supervisor_url=supervisor_url,
            serving_base_url=serving_base_url,
            model_urls=dict(model_urls),
            updated_at=at,
        )
    )
    return await write_domain(ex, stmt, about)
