"""The hardened listener over TLS: real sockets, certificates from trustme."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from haru_web import Listening, ServerLimits, TlsConfigError, TlsFiles, serving


def _app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/hello", hello)
    return app


@asynccontextmanager
async def _serve(files: TlsFiles) -> AsyncIterator[Listening]:
    async with serving(
        _app(), host="127.0.0.1", port=0, limits=ServerLimits(), shutdown_timeout=1, tls=files
    ) as listening:
        yield listening


def _client_context(ca_file: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


async def _peer_certificate(url: str, context: ssl.SSLContext) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    assert isinstance(der, bytes)
    return der


async def _get(url: str, context: ssl.SSLContext) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url + "/hello", ssl=context) as answer:
        assert answer.status == 200
        return await answer.json()


async def test_serves_https_and_no_plain_http_beside_it(pki: Any) -> None:
    cert, key = pki.leaf("server")
    async with _serve(TlsFiles(cert, key)) as listening:
        assert listening.url.startswith("https://127.0.0.1:")
        assert await _get(listening.url, _client_context(pki.ca_file)) == {"ok": True}
        # No plain HTTP beside it.
        plain = listening.url.replace("https://", "http://")
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.get(plain + "/hello") as answer:
                    await answer.read()


async def test_a_certificate_replaced_on_disk_is_served_to_the_next_connection(pki: Any) -> None:
    cert, key = pki.leaf("server")
    new_cert, new_key = pki.leaf("renewed", ca=pki.other)
    async with _serve(TlsFiles(cert, key)) as listening:
        first = await _peer_certificate(listening.url, _client_context(pki.ca_file))
        # Renewal as certbot does it: new files moved into place.
        os.replace(new_key, key)
        os.replace(new_cert, cert)
        second = await _peer_certificate(listening.url, _client_context(pki.other_ca_file))
        assert hashlib.sha256(second).digest() != hashlib.sha256(first).digest()
        assert second == ssl.PEM_cert_to_DER_cert(cert.read_text())
        assert await _get(listening.url, _client_context(pki.other_ca_file)) == {"ok": True}


async def test_a_broken_replacement_keeps_the_old_certificate(pki: Any) -> None:
    cert, key = pki.leaf("server")
    async with _serve(TlsFiles(cert, key)) as listening:
        first = await _peer_certificate(listening.url, _client_context(pki.ca_file))
        other_cert, _ = pki.leaf("mismatch", ca=pki.other)
        os.replace(other_cert, cert)  # the key no longer matches
        again = await _peer_certificate(listening.url, _client_context(pki.ca_file))
        assert again == first


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Any) -> None:
    cert, key = pki.leaf("server")
    client = pki.leaf("client")
    async with _serve(TlsFiles(cert, key, client_ca_file=pki.ca_file)) as listening:
        assert await _get(listening.url, _client_context(pki.ca_file, client)) == {"ok": True}
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.get(
                    listening.url + "/hello", ssl=_client_context(pki.ca_file)
                ) as answer:
                    await answer.read()
        stranger = pki.leaf("stranger", ca=pki.other)
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.get(
                    listening.url + "/hello", ssl=_client_context(pki.ca_file, stranger)
                ) as answer:
                    await answer.read()


async def test_files_that_do_not_load_refuse_to_listen(pki: Any, tmp_path: Path) -> None:
    cert, _ = pki.leaf("server")
    _, other_key = pki.leaf("other")
    with pytest.raises(TlsConfigError, match="cannot load the TLS certificate"):
        async with _serve(TlsFiles(cert, other_key)):
            pass
    with pytest.raises(TlsConfigError, match="cannot load"):
        async with _serve(TlsFiles(tmp_path / "missing.crt", other_key)):
            pass
