"""The bounds of a supervisor call: its time (heartbeat, probe) and the size of its answer."""

from __future__ import annotations

import aiohttp

from haru_supervisor_client._errors import SupervisorBadResponseError

MAX_RESPONSE_BYTES = 1024 * 1024
"""A supervisor answer larger than this is a bad response (it is never that large)."""

MIN_CALL_TIMEOUT_S = 0.001
"""A call is never given a zero or negative bound (aiohttp would read it as "no bound")."""

HEARTBEAT_TIMEOUT_S = 5.0
"""Bound of one heartbeat poll (DESIGN 7.3: about 5 s)."""

PROBE_REPLY_MARGIN_S = 2.0
"""Time the supervisor keeps, inside the HTTP bound of a probe call, to report its verdicts.

The supervisor bounds each model's completion by :func:`probe_timeout_ms` of the call's bound,
so a model that is too slow comes back as a failed result naming it, not as a call timeout."""


def probe_timeout_ms(call_timeout_s: float) -> int:
    """Per-model probe bound sent to the supervisor for a probe call bounded by ``call_timeout_s``.

    The HTTP bound minus :data:`PROBE_REPLY_MARGIN_S`; for a bound under twice that margin,
    half the bound. Never less than 1 ms.
    """
    margin = min(PROBE_REPLY_MARGIN_S, call_timeout_s / 2)
    return max(1, int((call_timeout_s - margin) * 1000))


async def read_bounded(response: aiohttp.ClientResponse, url: str) -> bytes:
    """The answer's body, refused as a bad response past :data:`MAX_RESPONSE_BYTES`."""
    length = response.content_length
    if length is not None and length > MAX_RESPONSE_BYTES:
        raise SupervisorBadResponseError(
            f"{url}: answer of {length} bytes exceeds {MAX_RESPONSE_BYTES}", url=url
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise SupervisorBadResponseError(
                f"{url}: answer exceeds {MAX_RESPONSE_BYTES} bytes", url=url
            )
        chunks.append(chunk)
    return b"".join(chunks)
