"""Repository-wide pytest set-up.

haru-db's pytest plugin (fresh migrated SQLite and PostgreSQL databases per test) is opt-in:
pytest only honours ``pytest_plugins`` in the root conftest, so it is requested here for
every member's tests. A lane that installs only some members (the SkyPilot lane installs the
drivers alone) runs without it.
"""

import importlib.util
import os
from collections.abc import Iterator

import pytest

pytest_plugins = ["haru_db.testing"] if importlib.util.find_spec("haru_db") is not None else []


if importlib.util.find_spec("trustme") is not None:
    from dataclasses import dataclass
    from datetime import UTC, datetime, timedelta
    from pathlib import Path

    import trustme

    @dataclass(frozen=True)
    class Pki:
        """Certificates for TLS tests: two CAs, leaves for 127.0.0.1, client certificates."""

        ca: trustme.CA
        other: trustme.CA
        ca_file: Path
        other_ca_file: Path
        tmp: Path

        def leaf(
            self, name: str, *, expired: bool = False, ca: trustme.CA | None = None
        ) -> tuple[Path, Path]:
            """A certificate for 127.0.0.1 and localhost: (cert file, key file)."""
            now = datetime.now(UTC)
            issuer = ca if ca is not None else self.ca
            cert = issuer.issue_cert(
                "127.0.0.1",
                "localhost",
                not_before=now - timedelta(days=10) if expired else None,
                not_after=now - timedelta(days=1) if expired else None,
            )
            cert_file, key_file = self.tmp / f"{name}.crt", self.tmp / f"{name}.key"
            cert.cert_chain_pems[0].write_to_path(str(cert_file))
            cert.private_key_pem.write_to_path(str(key_file))
            return cert_file, key_file

    @pytest.fixture
    def pki(tmp_path: Path) -> Pki:
        """Two fresh CAs (PEM files in ``tmp_path``); :meth:`Pki.leaf` issues certificates."""
        ca, other = trustme.CA(), trustme.CA()
        ca_file, other_file = tmp_path / "ca.pem", tmp_path / "other-ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        other.cert_pem.write_to_path(str(other_file))
        return Pki(ca=ca, other=other, ca_file=ca_file, other_ca_file=other_file, tmp=tmp_path)


if importlib.util.find_spec("haru_sim") is not None:
    from haru_sim import netlab as _netlab

    @pytest.fixture
    def netlab() -> Iterator[_netlab.Lab]:
        """A :class:`haru_sim.netlab.Lab` (hosts as network namespaces on a private bridge).

        Removed at teardown, processes and rules included. Skipped where namespaces cannot be
        made (not root, no ``ip``/``iptables``), except under CI (``CI`` set), where that is a
        failure: CI runs as root, so these tests must never silently skip there.
        """
        reason = _netlab.unavailable_reason()
        if reason is not None:
            if os.environ.get("CI"):
                pytest.fail(f"CI is set but the network lab cannot be made: {reason}")
            pytest.skip(f"network lab unavailable: {reason}")
        with _netlab.Lab() as lab:
            yield lab
