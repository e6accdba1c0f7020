"""The listening address: settable, but an open API is never exposed to a network by accident."""

from __future__ import annotations

import ipaddress
import re
from typing import Final

from haru_web._middleware import is_loopback_host

HOST_VAR: Final = "HARU_HOST"
OPEN_BIND_VAR: Final = "HARU_ALLOW_OPEN_BIND"
LOOPBACK: Final = "127.0.0.1"
ALL_INTERFACES: Final = "0.0.0.0"
"""All interfaces: the default only when a token guards the API."""

_LABEL: Final = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def normalize_bind_host(value: str) -> str:
    """Check a listening address (an IP literal or a host name) and return it normalised.

    Raises:
        ValueError: It is neither an IP address nor a valid host name.
    """
    text = value.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    name = text.rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(p) for p in name.split(".")):
        raise ValueError("must be an IP address or a host name (e.g. 0.0.0.0, ::, 127.0.0.1)")
    return name


def is_loopback_bind(host: str) -> bool:
    """Whether listening on ``host`` keeps the service reachable from this machine only."""
    return is_loopback_host(f"[{host}]" if ":" in host else host)


def choose_bind_host(host: str | None, *, token_set: bool, allow_open: bool, token_var: str) -> str:
    """The address a service listens on.

    Unset: all interfaces with a token, 127.0.0.1 without one. A non-loopback address without
    a token is refused unless the operator opted in (``HARU_ALLOW_OPEN_BIND``).

    Args:
        host: ``HARU_HOST`` (already normalised), or None when unset.
        token_set: Whether a bearer token guards the API.
        allow_open: ``HARU_ALLOW_OPEN_BIND``.
        token_var: The token's variable, named in the error.

    Raises:
        ValueError: A non-loopback address without a token and without the opt-in.
    """
    if host is None:
        return ALL_INTERFACES if token_set else LOOPBACK
    if token_set or allow_open or is_loopback_bind(host):
        return host
    raise ValueError(
        f"{HOST_VAR}={host} is not a loopback address and {token_var} is unset: the API would "
        f"be open to anyone on the network. Set {token_var}, or set {OPEN_BIND_VAR}=1 to "
        "serve it without authentication on purpose"
    )
