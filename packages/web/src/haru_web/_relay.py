"""Streaming an upstream's answer back to the client, never ending a truncated one cleanly.

Shared by the server's inference proxy and the supervisor's serving gateway: the status and
the body go back as they come, chunk by chunk; an upstream that breaks or goes silent
mid-answer breaks the client's connection instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import hdrs, web


async def relay_answer(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: Mapping[str, str],
    *,
    on_broken: Callable[[aiohttp.ClientError], None],
    on_client_gone: Callable[[], None],
    on_first_chunk: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Send ``upstream``'s body to the client with its status and ``headers``.

    A body that arrived whole with the headers goes in one write; any other is streamed chunk
    by chunk, framed by the upstream's ``Content-Length`` when it has one (a short body then
    reads as truncated to the client). The caller releases or closes ``upstream``.

    Args:
        request: The client's request.
        upstream: The upstream's answer, headers read.
        headers: The answer's headers (the caller picks which of the upstream's to copy).
        on_broken: Called when the upstream fails mid-answer (broken, or silent past the
            session's read timeout: ``aiohttp.ServerTimeoutError``); the client's connection
            is then closed without the final chunk.
        on_client_gone: Called when the client goes away mid-answer; the relay stops.
        on_first_chunk: Called once, as the first body bytes go to the client.
    """
    content = upstream.content
    if content.is_eof() and content.exception() is None:
        # Already in memory (a small JSON answer): one write instead of headers, body, end.
        if on_first_chunk is not None:
            on_first_chunk()
        return web.Response(status=upstream.status, body=content.read_nowait(), headers=headers)
    response = web.StreamResponse(status=upstream.status, headers=headers)
    length = upstream.content_length
    if length is not None and hdrs.CONTENT_ENCODING not in upstream.headers:
        # Framing, not a copied header: a known length spares chunked encoding.
        response.content_length = length
    first = on_first_chunk
    try:
        await response.prepare(request)
        while True:
            try:
                chunk = await content.readany()
            except aiohttp.ClientError as exc:
                on_broken(exc)
                # The client must see a broken answer, never a clean end of a truncated one.
                transport = request.transport
                if transport is not None:
                    transport.close()
                return response
            if not chunk:
                break
            await response.write(chunk)
            if first is not None:
                first()
                first = None
        await response.write_eof()
    except ConnectionError:
        on_client_gone()
    return response
