"""The per-fleet CA and the certificate issued to each provisioned domain (migration 0010).

The store keeps what it is given: a CA certificate and its key already sealed by the caller
(the server's store key never reaches this package), and the public facts of each issued
leaf. Creating a fleet's CA is an insert that does nothing when one exists, so racing
processes agree on the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from haru_db._exec import Executor, aware
from haru_db._tables import domain_certs, fleet_cas


@dataclass(frozen=True, slots=True)
class StoredFleetCa:
    """A fleet's CA as stored.

    Attributes:
        fleet_id: The fleet.
        cert_pem: The CA's PEM certificate.
        sealed_key: The CA's private key, sealed by the server's store key.
        created_at: When it was made.
    """

    fleet_id: UUID
    cert_pem: str
    sealed_key: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class DomainCert:
    """The public facts of the certificate issued to a domain before its latest launch.

    Attributes:
        domain_id: The domain.
        fleet_id: Its fleet (whose CA issued the certificate).
        attempt: The launch attempt it was issued for.
        server_name: The DNS name in the certificate (what the server checks).
        fingerprint: SHA-256 of the certificate (DER), 64 lower-case hex digits.
        not_after: When it expires.
        issued_at: When it was issued.
    """

    domain_id: UUID
    fleet_id: UUID
    attempt: int
    server_name: str
    fingerprint: str
    not_after: datetime
    issued_at: datetime


async def create_fleet_ca(
    ex: Executor, fleet_id: UUID, *, cert_pem: str, sealed_key: str, at: datetime
) -> StoredFleetCa:
    stmt = (
        ex.insert(fleet_cas)
        .values(fleet_id=fleet_id, cert_pem=cert_pem, sealed_key=sealed_key, created_at=aware(at))
        .on_conflict_do_nothing(index_elements=[fleet_cas.c.fleet_id])
    )
    await ex.write(stmt)
    found = await get_fleet_ca(ex, fleet_id)
    if found is None:  # pragma: no cover - rows of this table are never deleted
        raise RuntimeError("the fleet CA vanished right after it was written")
    return found


async def get_fleet_ca(ex: Executor, fleet_id: UUID) -> StoredFleetCa | None:
    rows = await ex.read(sa.select(fleet_cas).where(fleet_cas.c.fleet_id == fleet_id))
    if not rows:
        return None
    row = rows[0]
    return StoredFleetCa(row["fleet_id"], row["cert_pem"], row["sealed_key"], row["created_at"])


async def record_domain_cert(ex: Executor, cert: DomainCert) -> None:
    values = {
        "domain_id": cert.domain_id,
        "fleet_id": cert.fleet_id,
        "attempt": cert.attempt,
        "server_name": cert.server_name,
        "fingerprint": cert.fingerprint,
        "not_after": aware(cert.not_after),
        "issued_at": aware(cert.issued_at),
    }
    stmt = (
        ex.insert(domain_certs)
        .values(values)
        .on_conflict_do_update(
            index_elements=[domain_certs.c.domain_id],
            set_={k: v for k, v in values.items() if k != "domain_id"},
        )
    )
    await ex.write(stmt)


async def list_domain_certs(ex: Executor, fleet_id: UUID) -> list[DomainCert]:
    rows = await ex.read(sa.select(domain_certs).where(domain_certs.c.fleet_id == fleet_id))
    return [
        DomainCert(
            domain_id=row["domain_id"],
            fleet_id=row["fleet_id"],
            attempt=row["attempt"],
            server_name=row["server_name"],
            fingerprint=row["fingerprint"],
            not_after=row["not_after"],
            issued_at=row["issued_at"],
        )
        for row in rows
    ]
