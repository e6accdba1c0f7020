"""Client keys in the store: stored by hash, listed, revoked once, looked up by hash."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime, timedelta

import pytest
from haru_db import ConstraintViolationError, StateStore


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_a_key_is_created_looked_up_by_hash_and_revoked_once(
    store: StateStore, now: datetime
) -> None:
    fleet = uuid.uuid4()
    made = await store.create_client_key(
        uuid.uuid4(),
        name="billing-app",
        key_hash=_hash("k-one"),
        fleets=[fleet],
        models=["m1", "m2"],
        rpm=30,
        at=now,
    )
    open_key = await store.create_client_key(
        uuid.uuid4(),
        name="batch",
        key_hash=_hash("k-two"),
        fleets=None,
        models=None,
        rpm=None,
        at=now + timedelta(seconds=1),
    )
    found = await store.client_key_by_hash(_hash("k-one"))
    assert found == made
    assert found is not None
    assert found.fleets == (fleet,)
    assert found.models == ("m1", "m2")
    assert found.rpm == 30
    assert found.revoked_at is None
    assert await store.client_key_by_hash(_hash("nobody")) is None
    assert [k.id for k in await store.list_client_keys()] == [made.id, open_key.id]

    revoked = await store.revoke_client_key(made.id, at=now + timedelta(minutes=1))
    assert revoked is not None
    assert revoked.revoked_at == now + timedelta(minutes=1)
    again = await store.revoke_client_key(made.id, at=now + timedelta(minutes=2))
    assert again is not None
    assert again.revoked_at == now + timedelta(minutes=1)
    looked = await store.client_key_by_hash(_hash("k-one"))
    assert looked is not None
    assert looked.revoked_at == now + timedelta(minutes=1)
    assert await store.revoke_client_key(uuid.uuid4(), at=now) is None


async def test_two_keys_never_share_a_hash(store: StateStore, now: datetime) -> None:
    await store.create_client_key(
        uuid.uuid4(), name="a", key_hash=_hash("same"), fleets=None, models=None, rpm=None, at=now
    )
    with pytest.raises(ConstraintViolationError):
        await store.create_client_key(
            uuid.uuid4(),
            name="b",
            key_hash=_hash("same"),
            fleets=None,
            models=None,
            rpm=None,
            at=now,
        )
