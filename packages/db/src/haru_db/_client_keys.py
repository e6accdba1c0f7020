"""Inference client keys (migration 0011): stored by hash, revoked by a timestamp.

The store never sees a key: the caller hands it the SHA-256 and looks keys up by it. A revoked
key keeps its row (its id stays meaningful in old logs); a lookup reports it revoked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from haru_db._exec import Executor, aware
from haru_db._tables import client_keys


@dataclass(frozen=True, slots=True)
class ClientKey:
    """A client key as stored (without the key, which is never stored).

    Attributes:
        id: What logs and metric labels name.
        name: The operator's name for it.
        fleets: Fleet ids it may use; None: any fleet.
        models: Model names it may ask for; None: any model.
        rpm: Requests per minute per server process; None: no limit.
        created_at: When it was created.
        revoked_at: When it was revoked; None while it is valid.
    """

    id: UUID
    name: str
    fleets: tuple[UUID, ...] | None
    models: tuple[str, ...] | None
    rpm: int | None
    created_at: datetime
    revoked_at: datetime | None


def _of(row: Mapping[str, Any]) -> ClientKey:
    fleets = row["fleets"]
    models = row["models"]
    return ClientKey(
        id=row["id"],
        name=row["name"],
        fleets=None if fleets is None else tuple(UUID(str(f)) for f in fleets),
        models=None if models is None else tuple(str(m) for m in models),
        rpm=row["rpm"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


async def create_client_key(
    ex: Executor,
    key_id: UUID,
    *,
    name: str,
    key_hash: str,
    fleets: Sequence[UUID] | None,
    models: Sequence[str] | None,
    rpm: int | None,
    at: datetime,
) -> ClientKey:
    values = {
        "id": key_id,
        "name": name,
        "key_hash": key_hash,
        "fleets": None if fleets is None else [str(f) for f in fleets],
        "models": None if models is None else list(models),
        "rpm": rpm,
        "created_at": aware(at),
        "revoked_at": None,
    }
    await ex.write(ex.insert(client_keys).values(values))
    return _of(values)


async def list_client_keys(ex: Executor) -> list[ClientKey]:
    rows = await ex.read(
        sa.select(client_keys).order_by(client_keys.c.created_at, client_keys.c.id)
    )
    return [_of(row) for row in rows]


async def get_client_key(ex: Executor, key_id: UUID) -> ClientKey | None:
    rows = await ex.read(sa.select(client_keys).where(client_keys.c.id == key_id))
    return _of(rows[0]) if rows else None


async def revoke_client_key(ex: Executor, key_id: UUID, *, at: datetime) -> ClientKey | None:
    # Guarded on the key still being valid: a second revocation keeps the first time.
    await ex.write(
        sa.update(client_keys)
        .where(client_keys.c.id == key_id, client_keys.c.revoked_at.is_(None))
        .values(revoked_at=aware(at))
    )
    return await get_client_key(ex, key_id)


async def client_key_by_hash(ex: Executor, key_hash: str) -> ClientKey | None:
    rows = await ex.read(sa.select(client_keys).where(client_keys.c.key_hash == key_hash))
    return _of(rows[0]) if rows else None
