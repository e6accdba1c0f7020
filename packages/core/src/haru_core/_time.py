"""Time arguments: core never reads a clock, so every instant it compares must be aware."""

from __future__ import annotations

from datetime import datetime


def require_aware(name: str, value: datetime) -> datetime:
    """Return ``value``, or raise ValueError when it carries no UTC offset."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {value!r}")
    return value
