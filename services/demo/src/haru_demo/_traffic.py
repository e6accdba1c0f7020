"""Steady chat traffic through the server's proxy with the OpenAI SDK, every request recorded.

A few concurrent clients share one ``AsyncOpenAI`` (base URL: the server's ``/v1``), each
alternating streaming and non-streaming chat completions over the fleet's models. The SDK's
own retries are off, so every failed attempt counts. A request is good only when it ends with
content and ``finish_reason`` ``stop`` or ``length`` (an aborted generation is a failure even
with a 200). The ``openai`` package (a dependency of haru-demo) is imported when traffic starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

if TYPE_CHECKING:
    from openai import AsyncOpenAI

logger = logging.getLogger(__name__)

FLEET_HEADER: Final = "X-Haru-Fleet"
ROUTING_HEADER: Final = "X-Haru-Routing"
HELD_HEADER: Final = "X-Haru-Held-Ms"
_GOOD_FINISH: Final = frozenset({"stop", "length"})
_ERROR_LIMIT: Final = 200


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One chat completion as a client saw it.

    Attributes:
        client: Index of the client that sent it.
        model: The requested model.
        stream: Whether it was a streaming request.
        started_at: Wall-clock seconds (epoch) when it was sent.
        ended_at: Wall-clock seconds (epoch) when it ended (answer complete or failure).
        ok: A complete, non-empty answer that was not aborted.
        stale: The proxy answered from its cached routing (``X-Haru-Routing: stale``).
        error: What went wrong, when not ok.
        cut: A stream that failed after its response had started (status and headers
            received, then the body broke off): no proxy can send it again, so ``failed`` does
            not count it; :attr:`TrafficSummary.cut` does.
        held_ms: How long the proxy held the request through a failover (``X-Haru-Held-Ms``),
            when it did.
    """

    client: int
    model: str
    stream: bool
    started_at: float
    ended_at: float
    ok: bool
    stale: bool = False
    error: str | None = None
    held_ms: int | None = None
    cut: bool = False


@dataclass(frozen=True, slots=True)
class TrafficSummary:
    """Counts over a set of records."""

    total: int
    ok: int
    failed: int
    """Requests that failed before their response started (cut streams excluded)."""
    stale: int
    held: int = 0
    """Answered requests the proxy held through a failover."""
    longest_hold_ms: int = 0
    cut: int = 0
    """Streams that failed after their response had started (see :attr:`RequestRecord.cut`)."""

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> TrafficSummary:
        """Summarise ``records``."""
        ok = sum(1 for r in records if r.ok)
        cut = sum(1 for r in records if r.cut and not r.ok)
        return cls(
            total=len(records),
            ok=ok,
            failed=len(records) - ok - cut,
            cut=cut,
            stale=sum(1 for r in records if r.stale),
            held=sum(1 for r in records if r.held_ms is not None),
            longest_hold_ms=max((r.held_ms or 0 for r in records), default=0),
        )


def _describe_error(exc: BaseException) -> str:
    import openai  # imported when traffic runs, not at import

    if isinstance(exc, openai.APIStatusError):
        code = None
        body = exc.body
        if isinstance(body, dict):
            error = body.get("error", body)
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                # Haru's envelope code (vLLM's numeric code repeats the status).
                code = error["code"]
        text = f"HTTP {exc.status_code}" + (f" {code}" if code else "")
    elif isinstance(exc, openai.APITimeoutError):
        text = "timeout"
    elif isinstance(exc, openai.APIConnectionError):
        text = f"connection failed: {exc.__cause__ or exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:_ERROR_LIMIT]


class ChatTraffic:
    """Concurrent OpenAI-SDK clients sending chat completions through a Haru server.

    Use ``async with ChatTraffic(...) as traffic:``; records accumulate in
    :attr:`records` until it stops.

    Args:
        base_url: The server (``http://127.0.0.1:8700``); requests go to its ``/v1``.
        fleet: Sent as ``X-Haru-Fleet`` (None: rely on the server's ``HARU_DEFAULT_FLEET``).
        models: Models to cycle through.
        clients: Concurrent clients.
        pause_s: Pause of each client between two requests.
        max_tokens: ``max_tokens`` of every request.
        timeout_s: Bound of each request (a request parked forever counts as failed).
        api_key: Bearer token of the server (``HARU_API_TOKEN``), if it has one.
        on_record: Called with each record as it lands.
    """

    def __init__(
        self,
        base_url: str,
        *,
        fleet: str | None,
        models: Sequence[str],
        clients: int = 4,
        pause_s: float = 0.05,
        max_tokens: int = 8,
        timeout_s: float = 15.0,
        api_key: str | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if not models:
            raise ValueError("traffic needs at least one model")
        if clients < 1:
            raise ValueError("traffic needs at least one client")
        self.base_url = base_url.rstrip("/")
        self.fleet = fleet
        self.models = tuple(models)
        self.clients = clients
        self.pause_s = pause_s
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._client: AsyncOpenAI | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        """Whether the clients are sending."""
        return bool(self._tasks) and not self._stopping.is_set()

    def start(self) -> None:
        """Start the clients (idempotent)."""
        if self._tasks:
            return
        from openai import AsyncOpenAI  # imported when traffic starts

        headers = {FLEET_HEADER: self.fleet} if self.fleet else {}
        self._client = AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            # The SDK insists on a key; a server without HARU_API_TOKEN ignores it.
            api_key=self.api_key or "haru-demo",
            max_retries=0,
            timeout=self.timeout_s,
            default_headers=headers,
        )
        self._stopping.clear()
        self._tasks = [
            asyncio.create_task(self._run(index), name=f"haru-demo-traffic-{index}")
            for index in range(self.clients)
        ]

    async def stop(self, *, grace_s: float = 5.0) -> None:
        """Let every client finish its request in flight (bounded by ``grace_s``), then stop."""
        self._stopping.set()
        tasks, self._tasks = self._tasks, []
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def summary(self, *, since: float | None = None, until: float | None = None) -> TrafficSummary:
        """Counts of the requests :meth:`window` selects."""
        return TrafficSummary.of(self.window(since=since, until=until))

    def window(
        self, *, since: float | None = None, until: float | None = None
    ) -> list[RequestRecord]:
        """Records of the requests in flight at some point of ``[since, until)``.

        A request that started before ``since`` and ended after it counts: it lived through
        whatever happened at ``since`` (wall-clock seconds).
        """
        return [
            r
            for r in self.records
            if (since is None or r.ended_at >= since) and (until is None or r.started_at < until)
        ]

    def rate(self, *, over_s: float = 3.0) -> float:
        """Requests per second that ended within the last ``over_s`` seconds."""
        since = time.time() - over_s
        return sum(1 for r in self.records if r.ended_at >= since) / over_s

    def first_good_after(self, at: float) -> RequestRecord | None:
        """The first good answer among requests sent at or after ``at``, by completion time."""
        good = [r for r in self.records if r.ok and r.started_at >= at]
        return min(good, key=lambda r: r.ended_at, default=None)

    async def _run(self, index: int) -> None:
        sent = 0
        while not self._stopping.is_set():
            model = self.models[(index + sent) % len(self.models)]
            stream = (index + sent) % 2 == 1
            record = await self.send(index, model, stream=stream, number=sent)
            sent += 1
            self.records.append(record)
            if self.on_record is not None:
                self.on_record(record)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.pause_s):
                    await self._stopping.wait()

    async def send(self, index: int, model: str, *, stream: bool, number: int) -> RequestRecord:
        """Send one chat completion and record how it went (never raises for a failure)."""
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a terse assistant."},
            {
                "role": "user",
                "content": f"client {index} request {number}: say something about failover",
            },
        ]
        started = time.time()
        try:
            if stream:
                answer = await self._streamed(model, messages)
            else:
                answer = await self._whole(model, messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # any failure of a request is a data point
            cut = isinstance(exc, _CutStreamError)
            cause: BaseException = exc.__cause__ if cut and exc.__cause__ is not None else exc
            return RequestRecord(
                cut=cut,
                client=index,
                model=model,
                stream=stream,
                started_at=started,
                ended_at=time.time(),
                ok=False,
                error=_describe_error(cause),
            )
        ok = bool(answer.text) and answer.finish in _GOOD_FINISH
        return RequestRecord(
            client=index,
            model=model,
            stream=stream,
            started_at=started,
            ended_at=time.time(),
            ok=ok,
            stale=answer.stale,
            held_ms=answer.held_ms,
            error=None
            if ok
            else f"bad answer: finish_reason={answer.finish!r}, {len(answer.text)} chars",
        )

    def _open_client(self) -> AsyncOpenAI:
        if self._client is None:
            raise RuntimeError("traffic is not started")
        return self._client

    async def _streamed(self, model: str, messages: list[dict[str, str]]) -> _Answer:
        from openai import AsyncStream

        raw = await self._open_client().chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]  # plain dicts are valid params
            max_tokens=self.max_tokens,
            stream=True,
        )
        stale = raw.headers.get(ROUTING_HEADER, "").lower() == "stale"
        held_ms = _held_ms(raw.headers.get(HELD_HEADER))
        # The status and headers have arrived: from here on the response has started, and a
        # failure cannot be undone by sending the request again.
        try:
            chunks = raw.parse()
        except Exception as exc:
            raise _CutStreamError from exc
        if not isinstance(chunks, AsyncStream):
            raise TypeError(f"expected a stream, got {type(chunks).__name__}")
        content: list[str] = []
        finish: str | None = None
        try:
            async for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        content.append(choice.delta.content)
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
        except Exception as exc:
            raise _CutStreamError from exc
        finally:
            await chunks.close()
        return _Answer(text="".join(content), finish=finish, stale=stale, held_ms=held_ms)

    async def _whole(self, model: str, messages: list[dict[str, str]]) -> _Answer:
        raw = await self._open_client().chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]  # plain dicts are valid params
            max_tokens=self.max_tokens,
        )
        stale = raw.headers.get(ROUTING_HEADER, "").lower() == "stale"
        held_ms = _held_ms(raw.headers.get(HELD_HEADER))
        completion = raw.parse()
        if not completion.choices:
            return _Answer(text="", finish=None, stale=stale, held_ms=held_ms)
        choice = completion.choices[0]
        return _Answer(
            text=choice.message.content or "",
            finish=choice.finish_reason,
            stale=stale,
            held_ms=held_ms,
        )


class _CutStreamError(Exception):
    """A stream failed after its response had started (its cause is the failure)."""


@dataclass(frozen=True, slots=True)
class _Answer:
    text: str
    finish: str | None
    stale: bool
    held_ms: int | None = None


def _held_ms(value: str | None) -> int | None:
    return int(value) if value is not None and value.isascii() and value.isdigit() else None
