"""Paced generation and Server-Sent Events for the emulated vLLM's inference routes.

:func:`generate` admits a request into the engine and emits its pieces at the configured
pace; :func:`sse_response` streams them as ``data:`` events ending in ``[DONE]``, with the
``cut_stream_after_chunks`` fault and client disconnects handled like vLLM's server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from aiohttp import web

from haru_sim._engine import Engine, Generation
from haru_sim._engine_waits import ServerClosingError
from haru_sim._vllm_http import drop_connection

logger = logging.getLogger(__name__)

_P = TypeVar("_P")


async def generate(
    engine: Engine,
    pieces: Sequence[_P],
    natural_finish: str,
    emit: Callable[[_P], Awaitable[None]],
) -> tuple[int, str]:
    """Admit, then emit ``pieces`` at the configured pace. Returns (emitted, finish_reason).

    Raises:
        ServerClosingError: The server shut down meanwhile.
        ConnectionError: The client went away while a piece was written.
    """
    config = engine.config
    generation = Generation()
    if not await engine.admit(generation):
        return 0, "abort"
    emitted = 0
    finish = natural_finish
    try:
        for index, piece in enumerate(pieces):
            delay_ms = (
                config.first_token_latency_ms + engine.faults.slow_first_token_ms
                if index == 0
                else config.token_latency_ms
            )
            if not await engine.pace(generation, delay_ms / 1000):
                finish = "abort"
                break
            await emit(piece)
            emitted += 1
    except BaseException:
        engine.release(generation)
        raise
    engine.finish(generation, finish)
    return emitted, finish


class _StreamCutError(Exception):
    """The ``cut_stream_after_chunks`` fault fired."""


class SseWriter:
    def __init__(self, request: web.Request, cut_after: int | None) -> None:
        self._request = request
        self._cut_after = cut_after
        self._sent = 0
        self.response = web.StreamResponse(status=200)
        self.response.content_type = "text/event-stream"
        self.response.charset = "utf-8"

    async def start(self) -> None:
        await self.response.prepare(self._request)
        self._check_cut()

    def _check_cut(self) -> None:
        if self._cut_after is not None and self._sent >= self._cut_after:
            raise _StreamCutError

    async def send(self, event: Mapping[str, object] | str) -> None:
        data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())
        self._sent += 1
        self._check_cut()


async def sse_response(
    request: web.Request,
    engine: Engine,
    produce: Callable[[SseWriter], Awaitable[None]],
) -> web.StreamResponse:
    # vLLM returns a StreamingResponse before the engine produced anything, so the headers
    # go out at once, even while the request is parked behind a sleeping engine.
    writer = SseWriter(request, engine.faults.cut_stream_after_chunks)
    try:
        await writer.start()
        await produce(writer)
        await writer.send("[DONE]")
    except _StreamCutError:
        logger.info("cut_stream_after_chunks: closing %s mid-stream", request.path)
        drop_connection(request)
    except ServerClosingError:
        drop_connection(request)
    except ConnectionError:
        logger.info("client of %s went away mid-stream", request.path)
    return writer.response
