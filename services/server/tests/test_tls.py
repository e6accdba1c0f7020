"""The server over TLS, and its links to supervisors: real sockets, trustme PKI."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_db import StateStore, upgrade
from haru_demo.localfleet import LocalFleet
from haru_server._settings import Settings, SettingsError
from haru_server._settings_parse import parse_pins
from haru_server.cli import app as cli_app
from haru_supervisor.api import create_app as create_supervisor_app
from haru_web import ServerLimits, TlsFiles, serving
from pydantic import SecretStr
from typer.testing import CliRunner

MakeFleet = Callable[..., Awaitable[LocalFleet]]
RunningServer = Callable[[Settings], AbstractAsyncContextManager[str]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""


@asynccontextmanager
async def tls_supervisor(
    fleet: LocalFleet, slug: str, files: TlsFiles | None, *, host: str = "127.0.0.1"
) -> AsyncIterator[str]:
    """Serve the domain's real supervisor app over TLS; the layout names this URL."""
    domain = fleet.domain(slug)
    assert domain.supervisor_settings is not None
    app = create_supervisor_app(domain.supervisor_settings, exec_=domain._nvidia_smi)
    async with serving(
        app, host=host, port=0, limits=ServerLimits(), shutdown_timeout=1, tls=files
    ) as listening:
        yield listening.url


async def seed(db: str, fleet: LocalFleet, urls: dict[str, str]) -> None:
    for slug, url in urls.items():
        fleet.domain(slug).supervisor_url = url
    await upgrade(db)
    store = StateStore.open(db)
    try:
        await store.apply_fleet_layout(fleet.layout(), at=datetime.now(UTC))
    finally:
        await store.close()


async def reconcile_and_read(url: str, context: ssl.SSLContext, slug: str) -> dict[str, Any]:
    """One reconcile tick over HTTPS; each domain's ``lastSupervisorError`` by slug."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/fleets/{slug}/reconcile", json={}, ssl=context) as r:
            assert r.status == 200, await r.text()
        async with http.get(f"{url}/v1/fleets/{slug}", ssl=context) as r:
            assert r.status == 200
            fleet = await r.json()
    return {d["slug"]: d.get("lastSupervisorError") for d in fleet["domains"]}


def _fingerprint(cert_file: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_file.read_text())).hexdigest()


async def test_heartbeats_reach_tls_supervisors_and_bad_certificates_fail_clearly(
    running_server: RunningServer, make_fleet: MakeFleet, pki: Any, tmp_path: Path
) -> None:
    fleet = await make_fleet(domains=("good", "expired", "stranger", "pinned"))
    db = f"sqlite:///{tmp_path / 'tls.db'}"
    impostor_cert, _ = pki.leaf("impostor")
    async with (
        tls_supervisor(fleet, "good", TlsFiles(*pki.leaf("good"))) as good,
        tls_supervisor(fleet, "expired", TlsFiles(*pki.leaf("old", expired=True))) as expired,
        tls_supervisor(fleet, "stranger", TlsFiles(*pki.leaf("s", ca=pki.other))) as stranger,
        tls_supervisor(fleet, "pinned", TlsFiles(*pki.leaf("p", ca=pki.other))) as pinned,
    ):
        await seed(
            db,
            fleet,
            {"good": good, "expired": expired, "stranger": stranger, "pinned": pinned},
        )
        server_cert, server_key = pki.leaf("server")
        pinned_address = pinned.removeprefix("https://")
        settings = Settings(
            database_url=db,
            port=0,
            tls_cert_file=server_cert,
            tls_key_file=server_key,
            supervisor_ca_file=pki.ca_file,
            supervisor_pins=parse_pins(f"{pinned_address}={_fingerprint(impostor_cert)}"),
        )
        context = ssl.create_default_context(cafile=pki.ca_file)
        async with running_server(settings) as url:
            assert url.startswith("https://127.0.0.1:")
            errors = await reconcile_and_read(url, context, fleet.options.slug)
    assert errors["good"] is None
    assert "certificate has expired" in errors["expired"]
    assert "certificate verif" in errors["stranger"]
    assert "is not the pinned" in errors["pinned"]


async def test_a_pinned_supervisor_answers_and_the_cli_trusts_haru_ca_file(
    running_server: RunningServer, make_fleet: MakeFleet, pki: Any, tmp_path: Path
) -> None:
    fleet = await make_fleet(domains=("alpha", "beta"))
    db = f"sqlite:///{tmp_path / 'pin.db'}"
    cert, key = pki.leaf("alpha", ca=pki.other)
    async with tls_supervisor(fleet, "alpha", TlsFiles(cert, key)) as alpha:
        await seed(db, fleet, {"alpha": alpha})
        server_cert, server_key = pki.leaf("server")
        settings = Settings(
            database_url=db,
            port=0,
            tls_cert_file=server_cert,
            tls_key_file=server_key,
            supervisor_pins=parse_pins(f"{alpha.removeprefix('https://')}={_fingerprint(cert)}"),
        )
        context = ssl.create_default_context(cafile=pki.ca_file)
        async with running_server(settings) as url:
            errors = await reconcile_and_read(url, context, fleet.options.slug)
            assert errors == {"alpha": None, "beta": None}

            def cli(**env: str) -> Any:
                return CliRunner().invoke(
                    cli_app, ["fleets", "--url", url, "--json"], env={"HARU_API_TOKEN": "", **env}
                )

            trusted = await asyncio.to_thread(cli, HARU_CA_FILE=str(pki.ca_file))
            assert trusted.exit_code == 0, trusted.output
            assert fleet.options.slug in trusted.output
            untrusted = await asyncio.to_thread(cli, HARU_CA_FILE=str(pki.other_ca_file))
            assert untrusted.exit_code != 0
            assert "failed verification" in untrusted.output


@pytest.mark.parametrize("allowed", [False, True])
async def test_a_plain_http_supervisor_on_another_host_is_refused_unless_allowed(
    running_server: RunningServer,
    make_fleet: MakeFleet,
    pki: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    outside_address: str,
    allowed: bool,
) -> None:
    address = outside_address
    token = "plain-supervisor-token-1"  # a token-less supervisor refuses other hosts
    fleet = await make_fleet(domains=("alpha", "beta"), supervisor_token=token)
    db = f"sqlite:///{tmp_path / 'plain.db'}"
    async with tls_supervisor(fleet, "alpha", None, host="0.0.0.0") as local:
        remote = local.replace("0.0.0.0", address).replace("127.0.0.1", address)
        await seed(db, fleet, {"alpha": remote})
        settings = Settings(
            database_url=db, port=0, allow_plaintext=allowed, supervisor_token=SecretStr(token)
        )
        caplog.set_level(logging.WARNING)
        async with running_server(settings) as url:
            errors = await reconcile_and_read(url, ssl.create_default_context(), "local")
    log = caplog.text
    if allowed:
        assert errors["alpha"] is None
        assert f"domain alpha of fleet local: supervisor {remote} is reached in CLEAR TEXT" in log
    else:
        assert "refused: plain HTTP to another host" in errors["alpha"]
        assert "HARU_ALLOW_PLAINTEXT=1" in errors["alpha"]
        assert f"supervisor {remote} is plain HTTP on another host" in log
    assert errors["beta"] is None  # loopback stays allowed


def test_tls_settings_are_checked_at_boot(pki: Any, tmp_path: Path) -> None:
    cert, _ = pki.leaf("server")
    with pytest.raises(SettingsError, match="HARU_TLS_CERT_FILE and HARU_TLS_KEY_FILE"):
        Settings.from_env({"HARU_TLS_CERT_FILE": str(cert)})
    with pytest.raises(SettingsError, match="HARU_SUPERVISOR_PINS"):
        Settings.from_env({"HARU_SUPERVISOR_PINS": "10.0.0.1:8701=abc"})
    pinned = Settings.from_env({"HARU_SUPERVISOR_PINS": f"Sup.Example:8701={'AB:' * 31}AB"})
    assert pinned.supervisor_pins == {"sup.example:8701": bytes([0xAB] * 32)}
    with pytest.raises(SettingsError, match="HARU_SUPERVISOR_CA_FILE"):
        Settings.from_env(
            {"HARU_SUPERVISOR_CA_FILE": str(tmp_path / "missing.pem")}
        ).supervisor_links()


async def test_haru_serve_refuses_tls_files_that_do_not_load(
    haru_serve: HaruServe, pki: Any, tmp_path: Path
) -> None:
    cert, _ = pki.leaf("server")
    _, other_key = pki.leaf("other")
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'boot.db'}",
        "HARU_CREATE_DATABASE": "1",  # only the TLS files are wrong
        "PORT": "0",
        "HARU_TLS_CERT_FILE": str(cert),
        "HARU_TLS_KEY_FILE": str(other_key),
    }
    async with haru_serve(env, listening=False) as server:
        code = await server.exited()
    assert code == 2, server.log
    assert "cannot load the TLS certificate" in server.log
    assert "Traceback" not in server.log
