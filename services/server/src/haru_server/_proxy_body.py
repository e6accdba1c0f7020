"""The proxied request's body and what goes upstream with it (DESIGN 7.5).

The body is read under ``HARU_CHAT_MAX_BODY_BYTES`` (declared or chunked; over the cap a 413
before more is read, and no ``100 Continue`` invites it); the upstream gets only
``content-type``, ``accept`` and the request id of the client's headers, never its
``Authorization``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import hdrs, web
from haru_protocol import REQUEST_ID_HEADER, ErrorCode
from haru_web import ApiError, current_request_id


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request's body, refused with a 413 once it is past ``limit`` bytes.

    Raises:
        ApiError: The body is over the cap, or ended before its ``Content-Length``.
    """
    length = request.content_length
    if length is not None:
        if length > limit:
            raise _too_large(limit)
        try:
            return await request.content.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ApiError(
                ErrorCode.INVALID_REQUEST, "the request body ended before its Content-Length"
            ) from None
    # No declared length (chunked upload): read as it comes and stop one byte past the cap.
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the request body exceeds HARU_CHAT_MAX_BODY_BYTES ({limit} bytes)",
    )


async def expect_continue(request: web.Request, limit: int | None) -> None:
    """Answer ``Expect: 100-continue``, unless the declared body is past ``limit``.

    ``limit``: the body cap (None: no proxy runs to say one).
    """
    # aiohttp's default answers "100 Continue" to any Expect before anything else runs, which
    # invites a client to send a body the cap will refuse. Over the cap, stay silent: the
    # handler (after the bearer check) answers 413 without reading the body.
    length = request.content_length
    if limit is not None and length is not None and length > limit:
        return
    if request.version != aiohttp.HttpVersion11:
        return
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown expectation {expect[:100]!r}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the 100 is not part of the response


def upstream_headers(request: web.BaseRequest) -> dict[str, str]:
    """The headers the upstream gets with the body (its serving credential is added later)."""
    headers: dict[str, str] = {
        hdrs.CONTENT_TYPE: request.headers.get(hdrs.CONTENT_TYPE, "application/json"),
        # The answer is relayed byte for byte with only content-type copied back, so it
        # must not arrive compressed.
        hdrs.ACCEPT_ENCODING: "identity",
    }
    accept = request.headers.get(hdrs.ACCEPT)
    if accept is not None:
        headers[hdrs.ACCEPT] = accept
    request_id = current_request_id()
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return headers
