"""``/v1/keys``: create, list and revoke inference client keys (admin token only).

A key is made here from 32 random bytes and shown once, in the answer to its creation; the
store keeps only its SHA-256. Revoking keeps the row (its id stays meaningful in old logs);
every server process refuses the key within one route lease (see :mod:`_client_keys`).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Final
from uuid import UUID

from aiohttp import web
from haru_db import ClientKey
from haru_protocol import (
    ClientKeyCreate,
    ClientKeyCreated,
    ClientKeyList,
    ClientKeyView,
    ErrorCode,
    parse_fleet_ref,
)
from haru_web import ApiError, json_model, parse_body

from haru_server._client_keys import key_hash
from haru_server._keys import clock_key, store_key

logger = logging.getLogger(__name__)

key_routes = web.RouteTableDef()

KEY_PREFIX: Final = "hk_"
"""What every client key starts with (so a leaked one is recognisable by secret scanners)."""

_BODY_LIMIT: Final = 64 * 1024


def _view(key: ClientKey) -> ClientKeyView:
    return ClientKeyView(
        id=key.id,
        name=key.name,
        fleet_ids=key.fleets,
        models=key.models,
        rpm=key.rpm,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
    )


@key_routes.post("/v1/keys")
async def create_key(request: web.Request) -> web.Response:
    body = await parse_body(request, ClientKeyCreate, limit=_BODY_LIMIT)
    store = request.app[store_key]
    fleets: list[UUID] | None = None
    if body.fleets is not None:
        fleets = []
        for text in body.fleets:
            ref = parse_fleet_ref(text)
            pointer = None if ref.names_nothing else await store.get_fleet_route_pointer(ref)
            if pointer is None:
                raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {text[:100]!r} not found")
            if pointer.id not in fleets:
                fleets.append(pointer.id)
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = await store.create_client_key(
        uuid.uuid4(),
        name=body.name,
        key_hash=key_hash(secret),
        fleets=fleets,
        models=body.models,
        rpm=body.rpm,
        at=request.app[clock_key](),
    )
    logger.info("client key %s created (name %s)", key.id, key.name)
    return json_model(ClientKeyCreated(key=_view(key), secret=secret), status=201)


@key_routes.get("/v1/keys")
async def list_keys(request: web.Request) -> web.Response:
    keys = await request.app[store_key].list_client_keys()
    return json_model(ClientKeyList(keys=tuple(_view(k) for k in keys)))


@key_routes.delete("/v1/keys/{id}")
async def revoke_key(request: web.Request) -> web.Response:
    raw = request.match_info["id"]
    try:
        key_id = UUID(raw)
    except ValueError:
        raise ApiError(ErrorCode.NOT_FOUND, f"client key {raw[:100]!r} not found") from None
    store = request.app[store_key]
    key = await store.revoke_client_key(key_id, at=request.app[clock_key]())
    if key is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"client key {key_id} not found")
    logger.info("client key %s revoked", key.id)
    return json_model(_view(key))
