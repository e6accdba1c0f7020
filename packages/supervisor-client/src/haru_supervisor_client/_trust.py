"""How a supervisor's link is trusted: TLS contexts, pinned and issued certificates, plain HTTP.

:class:`SupervisorLinks` says how supervisors on other hosts are reached; a plain ``http://``
link is allowed to loopback (:func:`is_loopback_url`), or beyond it only when the links allow
it.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit


def client_ssl_context(
    ca_file: Path | None = None,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
) -> ssl.SSLContext:
    """A verifying client context: TLS 1.2 or newer, the peer's certificate and name checked.

    Args:
        ca_file: PEM bundle of the CAs to trust; None = the system trust store.
        cert_file: Client certificate for mutual TLS (with ``key_file``).
        key_file: Its private key.

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: A file is not usable PEM, or the key does not match.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def pin_key(url: str) -> str:
    """The key of a URL's endpoint in :attr:`SupervisorLinks.pins`: ``host:port``.

    Lower case, the default port written out, IPv6 in brackets.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _no_pins() -> Mapping[str, bytes]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class IssuedTrust:
    """How one supervisor whose certificate the server issued is verified.

    Attributes:
        ssl: A verifying context that trusts only the issuing CA.
        server_name: The DNS name its certificate must carry (sent as SNI and checked in
            place of the URL's host, which is an address the certificate cannot name).
    """

    ssl: ssl.SSLContext
    server_name: str


def _no_issued() -> Mapping[str, IssuedTrust]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SupervisorLinks:
    """How supervisors on other hosts are reached.

    Attributes:
        ssl: The verifying context of ``https://`` calls (:func:`client_ssl_context`; it may
            carry a client certificate); None = the system trust store.
        pins: SHA-256 digests of the leaf certificate (DER) by :func:`pin_key` of the
            supervisor URL. A pinned endpoint is trusted by that digest only, not by a CA
            (and presents no client certificate).
        allow_plaintext: Allow ``http://`` to a host other than loopback (a private network);
            otherwise such a call is refused before anything is sent.
        issued: :class:`IssuedTrust` by :func:`pin_key` of the supervisor URL, for
            supervisors whose certificate the server issued (``skypilot`` domains); it may be
            a live mapping the server fills as domains get addresses. It wins over ``pins``.
    """

    ssl: ssl.SSLContext | None = None
    pins: Mapping[str, bytes] = field(default_factory=_no_pins)
    allow_plaintext: bool = False
    issued: Mapping[str, IssuedTrust] = field(default_factory=_no_issued)


# Pure, and asked once per supervisor call (each heartbeat).
@functools.lru_cache(maxsize=4096)
def is_loopback_url(url: str) -> bool:
    """The URL's host is ``localhost`` or a loopback address (the link stays on this host)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
