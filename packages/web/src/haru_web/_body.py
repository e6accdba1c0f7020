"""Bounded request bodies, strict JSON into a pydantic model, and strict query integers."""

from __future__ import annotations

import re
from typing import Final, TypeVar

from aiohttp import web
from haru_protocol import ErrorCode
from pydantic import BaseModel, ValidationError

from haru_web._errors import ApiError

_M = TypeVar("_M", bound=BaseModel)

VALIDATION_ERRORS_SHOWN: Final = 3
"""How many validation errors a 400 spells out (the rest are counted)."""

JSON_MEDIA_TYPE: Final = "application/json"

_ASCII_DIGITS: Final = re.compile(r"[0-9]+")


def describe_validation_error(exc: ValidationError, *, prefix: str = "invalid request body") -> str:
    """A short, input-free summary of a validation error (never echoes the body)."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = [
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
        for error in errors[:VALIDATION_ERRORS_SHOWN]
    ]
    more = len(errors) - len(parts)
    suffix = f" (and {more} more)" if more > 0 else ""
    return f"{prefix}: " + "; ".join(parts) + suffix


def require_json(request: web.Request) -> None:
    """Refuse a request whose declared ``Content-Type`` is not ``application/json`` (415).

    :func:`parse_body` calls it for every non-empty body: a browser's "simple" ``text/plain``
    or form POST never reaches a control route. An empty body carries nothing to interpret and
    passes whatever its type (HTTP clients label an empty POST ``application/octet-stream``).

    Raises:
        ApiError: 415 ``unsupported_media_type``.
    """
    if request.content_type != JSON_MEDIA_TYPE:
        raise ApiError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "request bodies must be sent as Content-Type: application/json",
        )


async def read_body(request: web.Request, *, limit: int) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes before buffering them.

    Raises:
        ApiError: 413 ``payload_too_large`` when the declared or streamed size exceeds ``limit``.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise ApiError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"request body of {declared} bytes exceeds the limit of {limit} bytes",
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ApiError(
                ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds the limit of {limit} bytes"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(
    request: web.Request, model: type[_M], *, limit: int, empty_ok: bool = False
) -> _M:
    """Read and validate a strict JSON body (415 unless declared JSON; 400 if invalid).

    Args:
        request: The request.
        model: The strict wire model of the body.
        limit: Byte cap (413 beyond it).
        empty_ok: Treat an empty body as ``{}`` (for routes whose every field is optional).
    """
    raw = await read_body(request, limit=limit)
    if raw.strip():
        require_json(request)
    elif not empty_ok:
        raise ApiError(ErrorCode.INVALID_REQUEST, "request body is empty; JSON expected")
    else:
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, describe_validation_error(exc)) from None


def int_query(request: web.Request, name: str, default: int, *, low: int, high: int) -> int:
    """A query parameter of ASCII digits only (no sign, no ``_``, no other script's digits).

    Raises:
        ApiError: 400 ``invalid_request`` when malformed or outside ``[low, high]``.
    """
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if _ASCII_DIGITS.fullmatch(raw) is None:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"query parameter {name!r} must be a non-negative integer in ASCII digits",
        )
    # Beyond 20 digits the value is out of any range we take (and int() would refuse 4,300+).
    value = int(raw) if len(raw) <= 20 else high + 1
    if not low <= value <= high:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"query parameter {name!r} must be between {low} and {high}"
        )
    return value
