"""The supervisor client over TLS and its plain-HTTP policy: real sockets, trustme PKI."""

from __future__ import annotations

import hashlib
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from haru_supervisor_client import (
    SupervisorClient,
    SupervisorLinks,
    SupervisorPlaintextError,
    SupervisorTlsError,
    SupervisorUnreachableError,
    client_ssl_context,
    pin_key,
)
from haru_web import ServerLimits, TlsFiles, serving

STATUS = {"slots": [{"gpuIndex": 0, "kind": "inference", "models": []}], "ready": True}


@asynccontextmanager
async def _supervisor(
    files: TlsFiles | None, *, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[str, list[str]]]:
    """A listener answering ``GET /v1/status``; yields its URL and the tokens it saw."""
    seen: list[str] = []

    async def status(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response(STATUS)

    app = web.Application()
    app.router.add_get("/v1/status", status)
    async with serving(
        app, host=host, port=0, limits=ServerLimits(), shutdown_timeout=1, tls=files
    ) as listening:
        yield listening.url, seen


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


def _fingerprint(cert_file: Any) -> bytes:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_file.read_text())).digest()


async def test_a_tls_supervisor_is_verified_against_the_ca(
    pki: Any, session: aiohttp.ClientSession
) -> None:
    async with _supervisor(TlsFiles(*pki.leaf("sup"))) as (url, seen):
        links = SupervisorLinks(ssl=client_ssl_context(pki.ca_file))
        status = await SupervisorClient(session, token="t" * 16, links=links).status(
            url, timeout_s=5
        )
        assert status.ready
        assert seen == ["Bearer " + "t" * 16]
        # Another CA: refused with the reason, and the token never sent.
        wrong = SupervisorLinks(ssl=client_ssl_context(pki.other_ca_file))
        with pytest.raises(SupervisorTlsError, match="certificate verif"):
            await SupervisorClient(session, token="t" * 16, links=wrong).status(url, timeout_s=5)
        # The system trust store does not know a private CA either.
        with pytest.raises(SupervisorTlsError, match="certificate verif"):
            await SupervisorClient(session, token="t" * 16).status(url, timeout_s=5)
        assert len(seen) == 1


async def test_an_expired_certificate_fails_clearly(
    pki: Any, session: aiohttp.ClientSession
) -> None:
    async with _supervisor(TlsFiles(*pki.leaf("old", expired=True))) as (url, seen):
        links = SupervisorLinks(ssl=client_ssl_context(pki.ca_file))
        with pytest.raises(SupervisorTlsError, match="certificate has expired"):
            await SupervisorClient(session, token=None, links=links).status(url, timeout_s=5)
        assert seen == []


async def test_a_pinned_fingerprint_is_trusted_and_a_different_one_refused(
    pki: Any, session: aiohttp.ClientSession
) -> None:
    cert, key = pki.leaf("pinned", ca=pki.other)  # a CA the client does not trust
    other_cert, _ = pki.leaf("impostor")
    async with _supervisor(TlsFiles(cert, key)) as (url, seen):
        pinned = SupervisorLinks(
            ssl=client_ssl_context(pki.ca_file), pins={pin_key(url): _fingerprint(cert)}
        )
        assert (
            await SupervisorClient(session, token=None, links=pinned).status(url, timeout_s=5)
        ).ready
        wrong = SupervisorLinks(pins={pin_key(url): _fingerprint(other_cert)})
        with pytest.raises(SupervisorTlsError, match="is not the pinned"):
            await SupervisorClient(session, token=None, links=wrong).status(url, timeout_s=5)
        assert len(seen) == 1


async def test_mutual_tls_needs_the_client_certificate(
    pki: Any, session: aiohttp.ClientSession
) -> None:
    cert, key = pki.leaf("sup")
    client_cert, client_key = pki.leaf("server-client")
    async with _supervisor(TlsFiles(cert, key, client_ca_file=pki.ca_file)) as (url, seen):
        bare = SupervisorLinks(ssl=client_ssl_context(pki.ca_file))
        # TLS 1.3: the refusal comes after the client's handshake, as a closed connection.
        with pytest.raises(
            SupervisorUnreachableError, match=r"client certificate|CERTIFICATE_REQUIRED"
        ):
            await SupervisorClient(session, token=None, links=bare).status(url, timeout_s=5)
        assert seen == []
        mutual = SupervisorLinks(
            ssl=client_ssl_context(pki.ca_file, cert_file=client_cert, key_file=client_key)
        )
        assert (
            await SupervisorClient(session, token=None, links=mutual).status(url, timeout_s=5)
        ).ready


def _outside_address() -> str | None:
    """An address of this host that is not loopback (None where it has none)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


async def test_plain_http_to_another_host_is_refused_unless_allowed(
    session: aiohttp.ClientSession,
) -> None:
    address = _outside_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    async with _supervisor(None, host="0.0.0.0") as (local_url, seen):
        port = local_url.rsplit(":", 1)[1]
        url = f"http://{address}:{port}"
        with pytest.raises(SupervisorPlaintextError, match="HARU_ALLOW_PLAINTEXT"):
            await SupervisorClient(session, token="t" * 16).status(url, timeout_s=5)
        assert seen == []
        # Loopback stays allowed; an operator's opt-in allows the private network.
        assert (await SupervisorClient(session, token=None).status(local_url, timeout_s=5)).ready
        allowed = SupervisorLinks(allow_plaintext=True)
        client = SupervisorClient(session, token="t" * 16, links=allowed)
        assert (await client.status(url, timeout_s=5)).ready
        assert seen[-1] == "Bearer " + "t" * 16
