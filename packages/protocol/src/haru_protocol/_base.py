"""Base models and constrained scalar types shared by every wire document."""

from __future__ import annotations

import functools
import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt
from pydantic.alias_generators import to_camel

_SLUG_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

MAX_DURATION_MS = 2_147_483_647
"""Largest duration any document accepts (a signed 32-bit millisecond count)."""


class WireModel(BaseModel):
    """Base of every operator document and request body: camelCase, immutable, strict keys.

    An unknown or misspelled key is a validation error, so a typo in a layout or a request body
    is reported instead of silently ignored.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )


class PeerModel(BaseModel):
    """Base of responses parsed from a peer: camelCase, immutable, unknown keys ignored.

    A peer may run a newer version that adds fields; the reader keeps working.
    """

    model_config = ConfigDict(
        extra="ignore",
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )


def is_slug(value: str) -> bool:
    """Return whether ``value`` is a valid fleet/domain slug (a DNS label, 1 to 63 chars)."""
    return 1 <= len(value) <= 63 and _SLUG_RE.fullmatch(value) is not None


def _check_slug(value: str) -> str:
    if not is_slug(value):
        raise ValueError(
            f"invalid slug {value!r}: 1 to 63 chars of lowercase letters, digits and single "
            "hyphens, not starting or ending with a hyphen"
        )
    return value


def _check_model_name(value: str) -> str:
    if not value:
        raise ValueError("model name must not be empty")
    if value != value.lower():
        raise ValueError(f"model name {value!r} must be lowercase")
    return value


# Pure, and every snapshot read validates each domain's URLs again.
@functools.lru_cache(maxsize=4096)
def _check_http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"URL {value!r} must use http or https")
    if not parts.hostname:
        raise ValueError(f"URL {value!r} has no host")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"URL {value!r} has an invalid port") from exc
    return value


def _check_not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


Slug = Annotated[str, AfterValidator(_check_slug)]
"""Fleet or domain slug: a DNS label (``^[a-z0-9]+(-[a-z0-9]+)*$``, 1 to 63 chars)."""

ModelName = Annotated[str, AfterValidator(_check_model_name)]
"""Routing key of a model: non-empty and equal to its own lowercase form."""

HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
"""An absolute http or https URL, kept exactly as written (no normalisation)."""

NonEmptyStr = Annotated[str, AfterValidator(_check_not_blank)]
"""A string with at least one non-space character."""

DurationMs = Annotated[StrictInt, Field(gt=0, le=MAX_DURATION_MS)]
"""A positive duration in integer milliseconds."""

GpuIndex = Annotated[StrictInt, Field(ge=0)]
"""Index of a GPU on its host, as CUDA and nvidia-smi number them."""

Port = Annotated[StrictInt, Field(ge=1, le=65535)]
"""A TCP port."""

Flag = StrictBool
"""A JSON boolean (no string or number coercion)."""
