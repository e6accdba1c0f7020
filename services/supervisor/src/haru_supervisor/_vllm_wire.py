"""vLLM's HTTP surface as the supervisor uses it: its routes, versions, bounded reads, errors.

Every route the supervisor calls on a local vLLM server is pinned here, with the oldest
version it drives, the bounds on what it reads back, the one-line description of a transport
failure, the sum of a Prometheus gauge and the test of a completion's answer. Nothing here
holds state or makes a call: :mod:`haru_supervisor._vllm` does.
"""

from __future__ import annotations

import errno
import json
import math
from collections.abc import Mapping
from typing import Final

import aiohttp
from packaging.version import InvalidVersion, Version
from prometheus_client.parser import text_string_to_metric_families

VLLM_HOST: Final = "127.0.0.1"
"""vLLM's admin routes are unauthenticated: they are reached on the loopback interface only."""

SLEEP_PATH: Final = "/sleep"
WAKE_PATH: Final = "/wake_up"
IS_SLEEPING_PATH: Final = "/is_sleeping"
METRICS_PATH: Final = "/metrics"
CHAT_PATH: Final = "/v1/chat/completions"
VERSION_PATH: Final = "/version"

MIN_VLLM_VERSION: Final = (0, 17)
"""Oldest vLLM the supervisor drives: ``/sleep`` pauses the scheduler first (and takes
``mode``) from 0.17.0 (vllm#34528); before, a sleep does not pause and requests keep running
on, or reach, a sleeping engine."""

SLEEP_MODE: Final = "abort"
"""``/sleep?mode=``: always ``abort`` (README "Sleep after a drain: abort, not wait")."""

DISABLE_LOG_STATS_FLAG: Final = "--disable-log-stats"

RUNNING_METRIC: Final = "vllm:num_requests_running"
WAITING_METRIC: Final = "vllm:num_requests_waiting"

SLEEP_LEVEL: Final = 1
"""Level-1 sleep: weights offloaded to CPU RAM, KV cache dropped, process alive."""

BODY_LIMIT: Final = 1024 * 1024
METRICS_LIMIT: Final = 8 * 1024 * 1024
EXCERPT: Final = 200


class BodyTooLargeError(Exception):
    pass


def parse_vllm_version(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.17.0rc1``, ``0.9.2.dev3``).

    Read as a PEP 440 version (vLLM's own scheme, ``packaging.version``); None for anything
    else (a source build may report any string).
    """
    try:
        release = Version(text.strip()).release
    except InvalidVersion:
        return None
    return (release[0], release[1] if len(release) > 1 else 0)


def version_refusal(version: str) -> str | None:
    """Why the supervisor refuses a server of this vLLM version, or None when it accepts it.

    An unparseable version is accepted (a source build may report anything): only a version
    proved older than :data:`MIN_VLLM_VERSION` is refused.
    """
    parsed = parse_vllm_version(version)
    if parsed is None or parsed >= MIN_VLLM_VERSION:
        return None
    minimum = ".".join(str(part) for part in MIN_VLLM_VERSION)
    shown = excerpt(version.encode())
    return (
        f"vLLM {shown} is not supported: the supervisor needs vLLM >= {minimum}.0, whose "
        "/sleep pauses the scheduler before sleeping (older releases keep serving requests "
        "on a sleeping engine); upgrade vLLM"
    )


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """Read a response body, refusing more than ``limit`` bytes."""
    if response.content_length is not None and response.content_length > limit:
        raise BodyTooLargeError
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError
        chunks.append(chunk)
    return b"".join(chunks)


def excerpt(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", errors="replace").split())
    return text if len(text) <= EXCERPT else text[:EXCERPT] + "..."


def describe(exc: BaseException, *, port: int, timeout_s: float) -> str:
    """One short line for a transport failure (never a stack trace, never a body dump)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {VLLM_HOST}:{port} ({exc.strerror or 'connection failed'})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(exc, BodyTooLargeError):
        return "the response body is too large"
    text = str(exc) or type(exc).__name__
    return excerpt(text.encode())


def json_object(body: bytes) -> Mapping[str, object] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def sum_metrics(text: str, names: frozenset[str]) -> dict[str, float]:
    """Sum every sample of each metric in ``names`` in a Prometheus text exposition.

    Several engines (data parallel) or label sets each contribute a sample; the sum is what
    the server as a whole holds. A metric with no parseable sample is absent from the result.

    Each sample line of a wanted metric is read by prometheus-client's parser on its own, so
    one malformed line (or one of an unrelated metric) costs only that sample, not the whole
    exposition; the histograms vLLM also exports are never parsed.
    """
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(tuple(names)):
            continue
        try:
            samples = [
                sample
                for family in text_string_to_metric_families(line + "\n")
                for sample in family.samples
            ]
        except ValueError:
            continue
        for sample in samples:
            if sample.name in names and not math.isnan(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def is_connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the server's process may have gone (refused, or dropped)."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError))


def is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` proves nothing listens on the port (the server is gone, not slow)."""
    return (
        isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno == errno.ECONNREFUSED
    )


_ANSWER_FIELDS: Final = ("content", "reasoning", "reasoning_content")


def has_answer(body: bytes) -> bool:
    data = json_object(body)
    choices = None if data is None else data.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") == "length":
            return True
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        for name in _ANSWER_FIELDS:
            value = message.get(name)
            if isinstance(value, str) and value:
                return True
    return False
