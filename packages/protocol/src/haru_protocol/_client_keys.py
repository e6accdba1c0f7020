"""Inference client keys: the bodies of ``/v1/keys`` (the proxy's credentials)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated
from uuid import UUID

from pydantic import Field, StrictInt, StringConstraints

from haru_protocol._base import PeerModel, WireModel

KeyName = Annotated[
    str, StringConstraints(strip_whitespace=True, min_length=1, max_length=100, pattern=r"^\S+$")
]
"""An operator's name for a key: 1-100 characters, no whitespace (it is never a metric
label: the key's id is)."""


class ClientKeyCreate(WireModel):
    """Body of ``POST /v1/keys``."""

    name: KeyName
    fleets: (
        Annotated[
            tuple[Annotated[str, Field(min_length=1, max_length=100)], ...],
            Field(min_length=1, max_length=100),
        ]
        | None
    ) = None
    """Fleets (slugs or ids) the key may use (at least one); each must exist. Omitted or null:
    any fleet."""
    models: (
        Annotated[
            tuple[Annotated[str, Field(min_length=1, max_length=200)], ...],
            Field(min_length=1, max_length=100),
        ]
        | None
    ) = None
    """Model names the key may ask for (at least one). Omitted or null: any model."""
    rpm: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    """Requests per minute, counted by each server process apart. Omitted or null: no limit."""


class ClientKeyView(PeerModel):
    """A client key as ``GET /v1/keys`` lists it (never the key itself)."""

    id: UUID
    """What access logs and the ``key`` metric label name."""
    name: str
    fleet_ids: tuple[UUID, ...] | None
    models: tuple[str, ...] | None
    rpm: int | None
    created_at: datetime
    revoked_at: datetime | None


class ClientKeyList(PeerModel):
    """Answer of ``GET /v1/keys``: every key, revoked ones included, oldest first."""

    keys: tuple[ClientKeyView, ...]


class ClientKeyCreated(PeerModel):
    """Answer of ``POST /v1/keys``: the key, shown this once and never again."""

    key: ClientKeyView
    secret: str
    """The key to send as ``Authorization: Bearer``; only its SHA-256 is stored."""
