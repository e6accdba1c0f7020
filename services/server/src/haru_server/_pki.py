"""The per-fleet CA of ``skypilot`` domains: the server issues each launch its TLS certificate.

The server keeps one CA per fleet in the store, its private key sealed (Fernet: AES-128-CBC
with HMAC-SHA256) with the store key read from ``HARU_STORE_KEY_FILE``. Before each launch it
issues the domain a fresh key and a certificate for the DNS name :func:`domain_server_name`
(valid :data:`DOMAIN_CERT_VALIDITY_DAYS` days by default; a relaunch issues a new one), records
the certificate's fingerprint and expiry, and hands the key and certificate to ``sky launch``
as secrets. The server then reaches that supervisor over ``https://``, trusting only the
fleet's CA and checking that name, so it knows what to trust before the machine exists.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Final
from uuid import UUID

from cryptography import x509
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from haru_db import DomainCert, StateStore
from haru_driver_skypilot import TLS_CERT_SECRET, TLS_KEY_SECRET
from haru_supervisor_client import IssuedTrust, pin_key

STORE_KEY_FILE_VAR: Final = "HARU_STORE_KEY_FILE"
"""The setting naming the file that holds the store key (a Fernet key, 44 characters)."""
DOMAIN_CERT_VALIDITY_DAYS: Final = 30
"""Default life of a domain's certificate; a relaunch issues a new one."""
CA_VALIDITY_DAYS: Final = 3650
"""Life of a fleet's CA."""
SERVER_NAME_SUFFIX: Final = "haru.internal"
"""The DNS suffix of the names in domain certificates (``.internal``: never a public name)."""

_BACKDATE = timedelta(minutes=5)


class PkiError(Exception):
    """The store key or a stored CA cannot be used (the message names the setting)."""


class StoreKey:
    """Seals and opens secrets kept in the store (the fleet CAs' keys).

    Args:
        key: A Fernet key (url-safe base64 of 32 bytes).

    Raises:
        PkiError: ``key`` is not a Fernet key.
    """

    def __init__(self, key: bytes) -> None:
        try:
            self._fernet = Fernet(key.strip())
        except (ValueError, TypeError):
            raise PkiError(
                f"{STORE_KEY_FILE_VAR} must hold a Fernet key (url-safe base64 of 32 bytes)"
            ) from None

    @classmethod
    def from_file(cls, path: Path) -> StoreKey:
        """Read the key from ``path``.

        Raises:
            PkiError: The file cannot be read or holds no Fernet key.
        """
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read {STORE_KEY_FILE_VAR} {str(path)!r}: {exc}") from None
        return cls(raw)

    @staticmethod
    def generate() -> str:
        """A new random key, as the text to write into the key file."""
        return Fernet.generate_key().decode("ascii")

    def seal(self, data: bytes) -> str:
        """``data`` encrypted and authenticated, as text."""
        return self._fernet.encrypt(data).decode("ascii")

    def open(self, sealed: str) -> bytes:
        """The data :meth:`seal` sealed.

        Raises:
            PkiError: It was sealed with another key, or altered.
        """
        try:
            return self._fernet.decrypt(sealed.encode("ascii"))
        except (InvalidToken, ValueError):
            raise PkiError(
                f"the stored fleet CA key does not open with {STORE_KEY_FILE_VAR}: the store "
                "was written with another key (restore that key file)"
            ) from None


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """A domain's certificate, issued before its launch.

    Attributes:
        cert_pem: The leaf's PEM certificate followed by the CA's (a chain).
        key_pem: The leaf's PEM private key (sent to the host as a secret, never stored).
        server_name: The DNS name it is valid for.
        fingerprint: SHA-256 of the leaf (DER), lower-case hex.
        not_after: When it expires.
    """

    cert_pem: str
    key_pem: str
    server_name: str
    fingerprint: str
    not_after: datetime

    def secrets(self) -> dict[str, str]:
        """The SkyPilot secrets carrying it (one line each: base64 of the PEM)."""
        return {
            TLS_CERT_SECRET: base64.b64encode(self.cert_pem.encode()).decode("ascii"),
            TLS_KEY_SECRET: base64.b64encode(self.key_pem.encode()).decode("ascii"),
        }


def domain_server_name(fleet: str, domain: str) -> str:
    """The DNS name in the certificate of ``domain`` of ``fleet`` (both slugs)."""
    return f"{domain}.{fleet}.{SERVER_NAME_SUFFIX}"


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")


def new_ca(fleet: str, *, now: datetime) -> tuple[str, str]:
    """A fresh CA for ``fleet``: ``(certificate PEM, private key PEM)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Haru"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Haru fleet {fleet} CA"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii"), _key_pem(key)


def issue_leaf(
    ca_cert_pem: str, ca_key_pem: str, server_name: str, *, now: datetime, days: int
) -> IssuedCert:
    """A key and a server certificate for ``server_name``, signed by the CA.

    Raises:
        PkiError: The CA's certificate or key does not load.
    """
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_cert_pem.encode())
        ca_key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    except ValueError as exc:
        raise PkiError(f"the stored fleet CA does not load: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise PkiError("the stored fleet CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = now + timedelta(days=days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    pem = cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
    return IssuedCert(
        cert_pem=pem + ca_cert_pem,
        key_pem=_key_pem(key),
        server_name=server_name,
        fingerprint=hashlib.sha256(der).hexdigest(),
        not_after=not_after,
    )


def trust_context(ca_cert_pem: str) -> ssl.SSLContext:
    """A client context that trusts only the fleet's CA (name and expiry checked)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_cert_pem)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class IssuedTrusts(Mapping[str, IssuedTrust]):
    """What the supervisor client trusts per ``host:port``: the fleet CA and the domain's name.

    Filled by the provisioner from the store (the domains' recorded addresses and issued
    certificates), so every server process sharing the store trusts the same supervisors.
    """

    def __init__(self) -> None:
        self._by_address: dict[str, IssuedTrust] = {}
        self._owner: dict[UUID, str] = {}

    def __getitem__(self, key: str) -> IssuedTrust:
        return self._by_address[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_address)

    def __len__(self) -> int:
        return len(self._by_address)

    def known(self, domain_id: UUID, url: str) -> bool:
        """Whether ``domain_id`` is trusted at ``url`` already."""
        key = pin_key(url)
        return self._owner.get(domain_id) == key and key in self._by_address

    def put(self, domain_id: UUID, url: str, trust: IssuedTrust) -> None:
        """Trust ``trust`` at ``url`` for ``domain_id`` (replacing its previous address)."""
        old = self._owner.get(domain_id)
        if old is not None:
            self._by_address.pop(old, None)
        key = pin_key(url)
        self._owner[domain_id] = key
        self._by_address[key] = trust


class FleetPki:
    """Issues domain certificates from the fleet CAs in the store.

    Args:
        store: The state store (holds the CAs, their keys sealed).
        key: The store key; None refuses every issue with :class:`PkiError`.
        validity_days: Life of an issued certificate.
    """

    def __init__(self, store: StateStore, key: StoreKey | None, *, validity_days: int = 30) -> None:
        self._store = store
        self._key = key
        self._days = validity_days
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._by_fleet: dict[UUID, ssl.SSLContext] = {}
        self.trusts = IssuedTrusts()

    async def issue(
        self,
        fleet_id: UUID,
        fleet: str,
        domain_id: UUID,
        domain: str,
        *,
        attempt: int,
        now: datetime,
    ) -> IssuedCert:
        """Issue ``domain`` a fresh certificate for launch ``attempt`` and record it.

        The fleet's CA is made on first use.

        Raises:
            PkiError: No store key is set, or it does not open the stored CA.
        """
        if self._key is None:
            raise PkiError(
                f"no store key: a skypilot domain is launched with a certificate from the "
                f"fleet's CA, whose key the store keeps sealed; set {STORE_KEY_FILE_VAR} to a "
                "file holding a Fernet key (see the server README, Provisioned domains)"
            )
        stored = await self._store.get_fleet_ca(fleet_id)
        if stored is None:
            cert_pem, key_pem = new_ca(fleet, now=now)
            stored = await self._store.create_fleet_ca(
                fleet_id, cert_pem=cert_pem, sealed_key=self._key.seal(key_pem.encode()), at=now
            )
        ca_key = self._key.open(stored.sealed_key).decode("ascii")
        issued = issue_leaf(
            stored.cert_pem, ca_key, domain_server_name(fleet, domain), now=now, days=self._days
        )
        await self._store.record_domain_cert(
            DomainCert(
                domain_id=domain_id,
                fleet_id=fleet_id,
                attempt=attempt,
                server_name=issued.server_name,
                fingerprint=issued.fingerprint,
                not_after=issued.not_after,
                issued_at=now,
            )
        )
        return issued

    async def refresh(
        self, fleet_id: UUID, fleet: str, addresses: Mapping[UUID, tuple[str, str]]
    ) -> None:
        """Trust the fleet's CA, under each domain's name, at its ``https://`` supervisor URL.

        Args:
            fleet_id: The fleet.
            fleet: Its slug.
            addresses: Domain id to ``(domain slug, supervisor URL)``.

        Reads the store only when a domain is not trusted at that URL yet.
        """
        for domain_id, (domain, url) in addresses.items():
            if self.trusts.known(domain_id, url):
                continue
            context = await self._context(fleet_id)
            if context is None:
                return
            self.trusts.put(domain_id, url, IssuedTrust(context, domain_server_name(fleet, domain)))

    async def domain_trust(self, fleet_id: UUID, fleet: str, domain: str) -> IssuedTrust | None:
        """How the proxy verifies ``domain``'s gateway: the fleet's CA and the domain's name.

        The store is read once per fleet (a fleet's CA never changes); None: the fleet has no
        CA (it never launched a domain).
        """
        context = self._by_fleet.get(fleet_id)
        if context is None:
            context = await self._context(fleet_id)
            if context is None:
                return None
            self._by_fleet[fleet_id] = context
        return IssuedTrust(context, domain_server_name(fleet, domain))

    async def _context(self, fleet_id: UUID) -> ssl.SSLContext | None:
        stored = await self._store.get_fleet_ca(fleet_id)
        if stored is None:
            return None
        context = self._contexts.get(stored.cert_pem)
        if context is None:
            context = self._contexts[stored.cert_pem] = trust_context(stored.cert_pem)
        return context
