"""Field types of the server's settings whose variables have a syntax of their own.

``HARU_SUPERVISOR_PINS`` (``host:port=sha256`` pairs), ``HARU_RECONCILE_FLEETS`` (a fleet list
or ``*``) and ``HARU_RECONCILE_INTERVAL_MS`` (``0`` or ``off`` for no loop) are parsed here
from their strings; a value built directly (tests, embedding) passes through as it is.
"""

from __future__ import annotations

from typing import Annotated

from haru_protocol import MAX_DURATION_MS
from haru_supervisor_client import pin_key
from haru_web import EnvInt
from pydantic import BeforeValidator, Field
from pydantic_settings import NoDecode

DurationMs = Annotated[EnvInt, Field(ge=1, le=MAX_DURATION_MS)]


def parse_pins(text: str) -> dict[str, bytes]:
    """``HARU_SUPERVISOR_PINS``: ``host:port=sha256hex`` pairs, comma-separated.

    Raises:
        ValueError: A pair is malformed (the message quotes the address, never more).
    """
    pins: dict[str, bytes] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        address, sep, digest = item.partition("=")
        hex_digest = digest.strip().replace(":", "").lower()
        if not sep or len(hex_digest) != 64 or not all(c in "0123456789abcdef" for c in hex_digest):
            raise ValueError(
                "must be host:port=<SHA-256 of the leaf certificate, 64 hex digits> pairs, "
                "comma-separated"
            )
        key = pin_key(f"https://{address.strip()}")
        if key.startswith((":", "[]")):
            raise ValueError("names a pin without a host")
        pins[key] = bytes.fromhex(hex_digest)
    return pins


def _pins(value: object) -> object:
    return parse_pins(value) if isinstance(value, str) else value


def _fleets(value: object) -> object:
    if not isinstance(value, str):
        return value
    if value.strip() == "*":
        return None
    fleets = tuple(f.strip() for f in value.split(",") if f.strip())
    if not fleets:
        raise ValueError("names no fleet; list fleets (a,b) or use * for every fleet")
    return fleets


def _loop_off(value: object) -> object:
    if isinstance(value, str) and value.strip().lower() in ("0", "off"):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return value


SupervisorPins = Annotated[dict[str, bytes], NoDecode, BeforeValidator(_pins)]
"""Supervisor address (``pin_key``) -> SHA-256 of its leaf certificate."""

FleetList = Annotated[tuple[str, ...] | None, NoDecode, BeforeValidator(_fleets)]
"""Fleet slugs or ids; None for every fleet (``*``). A list naming no fleet is refused."""

LoopIntervalMs = Annotated[DurationMs | None, BeforeValidator(_loop_off)]
"""Milliseconds between two ticks; None (``0``, ``off``) for no loop."""
