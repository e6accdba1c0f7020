"""The base of every typed audit event payload, and the field types the payloads share."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AwareDatetime,
    Field,
    PlainSerializer,
)

from haru_protocol._base import PeerModel
from haru_protocol._enums import (
    EventType,
)


def _absent_when_none(value: object) -> bool:
    return value is None


def _optional() -> Any:
    """A fact some events carry: absent from the stored JSON when None."""
    return Field(default=None, exclude_if=_absent_when_none)


def _iso(value: datetime) -> str:
    return value.isoformat()


IsoDatetime = Annotated[AwareDatetime, PlainSerializer(_iso, return_type=str)]
"""A timestamp stored as ``datetime.isoformat()`` writes it (``+00:00``, as before)."""

Role = Literal["active", "standby"]
"""A domain's role in its fleet when the event happened."""


class EventPayload(PeerModel):
    """Base of every typed event payload; ``event_type`` is the type it belongs to."""

    event_type: ClassVar[EventType]
