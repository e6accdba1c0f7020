"""Repository-wide pytest set-up.

haru-db's pytest plugin (fresh migrated SQLite and PostgreSQL databases per test) is opt-in:
pytest only honours ``pytest_plugins`` in the root conftest, so it is requested here for
every member's tests. A lane that installs only some members (the SkyPilot lane installs the
drivers alone) runs without it, and without the fixtures below that need what it lacks.

The ``sky`` fixture serves both driver packages' tests: one session-scoped definition, so
SkyPilot's process-wide state (HOME, API server port) is set up once per session.
"""

import importlib.util
import os
import socket
import types
import warnings
from collections.abc import Iterator

import pytest

pytest_plugins = ["haru_db.testing"] if importlib.util.find_spec("haru_db") is not None else []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def sky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """SkyPilot itself, imported in an isolated environment; skips without the ``sky`` extra.

    Before the import (SkyPilot caches paths and its server URL process-wide): HOME is a temp
    folder (``import sky`` writes ``~/.sky``), usage collection is off, and any API server is
    a private one on a free port (SKYPILOT_API_SERVER_LOCAL_PORT, honoured by client and
    server), so an operator's server is neither used nor stopped. The environment stays until
    the session ends. The sky lane (.ci/sky-lane.sh) installs the extra and fails if the tests
    using this fixture were skipped.
    """
    home = tmp_path_factory.mktemp("sky-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.setenv("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
        mp.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(_free_port()))
        mp.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
        # SkyPilot's own imports emit deprecation warnings (SQLAlchemy declarative_base, ...)
        # that the suite's filterwarnings=error would turn into failures; they are not ours.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = pytest.importorskip("sky")
            pytest.importorskip("sky.serve")
            pytest.importorskip("sky.utils.schemas")
            pytest.importorskip("sky.utils.common_utils")
        yield module


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
