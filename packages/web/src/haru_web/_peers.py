"""Who is on the other end of a connection: trusted proxies, ``X-Forwarded-For``, peer groups."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

TRUSTED_PROXIES_VAR: Final = "HARU_TRUSTED_PROXIES"
"""Comma-separated addresses or networks (CIDR) of reverse proxies whose ``X-Forwarded-For``
is believed; unset: none (the header is never used)."""

IPV6_PEER_PREFIX: Final = 64
"""An IPv6 client holds a whole /64 as a rule: its connections are counted together."""

_UNKNOWN: Final = "-"


def parse_trusted_proxies(value: str | Iterable[str] | None) -> tuple[Network, ...]:
    """``HARU_TRUSTED_PROXIES``: a comma-separated list (or an iterable) of addresses/networks.

    Raises:
        ValueError: An entry is neither an IP address nor a network in CIDR notation.
    """
    if value is None:
        return ()
    entries = value.split(",") if isinstance(value, str) else value
    networks: list[Network] = []
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(
                f"{text!r} is not an IP address or a network (CIDR, e.g. 10.0.0.0/8)"
            ) from None
    return tuple(networks)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_trusted(address: str | None, trusted: tuple[Network, ...]) -> bool:
    """Whether ``address`` (a peer's IP as text) is in one of the ``trusted`` networks."""
    if not trusted or not address:
        return False
    parsed = _address(address)
    return parsed is not None and any(parsed in network for network in trusted)


def forwarded_client(
    direct: str | None, forwarded_for: str | None, trusted: tuple[Network, ...]
) -> str:
    """The client's address: ``direct``, or from ``X-Forwarded-For`` when ``direct`` is trusted.

    The header is read right to left (each proxy appends the address it was reached from),
    skipping trusted proxies; the first address that is not one is the client. An entry that
    is not an IP address ends the walk at the proxy that wrote it: anything further left was
    written by the client and proves nothing.
    """
    current = direct or _UNKNOWN
    if not forwarded_for or not is_trusted(direct, trusted):
        return current
    for entry in reversed(forwarded_for.split(",")):
        address = _address(entry)
        if address is None:
            return current
        current = str(address)
        if not any(address in network for network in trusted):
            return current
    return current


def peer_group(address: str | None) -> str:
    """The key a peer's connections are counted under: its IPv4 address, or its IPv6 /64."""
    if not address:
        return _UNKNOWN
    parsed = _address(address)
    if parsed is None:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((parsed, IPV6_PEER_PREFIX), strict=False))
    return str(parsed)
