"""The emulated vLLM OpenAI server: routes, request validation, SSE, admin and control routes.

Shapes follow vLLM 0.33 (``vllm serve --enable-sleep-mode`` with ``VLLM_SERVER_DEV_MODE=1``):
OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}``, FastAPI's
``{"detail": "Not Found"}`` for unknown routes, exact case-sensitive model names, and the
dev-mode sleep routes. See the package README for every route and knob.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from aiohttp import web

from haru_sim._config import SLEEP_MODES, SleepMode, VllmSimConfig
from haru_sim._engine import (
    Engine,
    Generation,
    RecordedRequest,
    ServerClosingError,
    SimulatedFaultError,
)
from haru_sim._errors import SimConfigError, SimUnsupportedError

logger = logging.getLogger(__name__)

ENGINE_KEY: Final = web.AppKey("haru_sim_engine", Engine)

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
EMBEDDINGS_PATH: Final = "/v1/embeddings"
INFERENCE_PATHS: Final = frozenset({CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH})
CONTROL_PREFIX: Final = "/_sim/"

# vLLM puts no cap of its own on bodies; Haru's proxy default is 32 MiB, so leave room above it.
_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
_COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions
_FALLBACK_WORDS: Final = ("ok",)
_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
# vllm/entrypoints/serve/middleware/authenticate.py (0.33.0): only these need the API key.
_GUARDED_PREFIXES: Final = ("/v1", "/v2", "/inference", "/cohere")

_P = TypeVar("_P")


class OpenAIError(Exception):
    """Rendered as vLLM's OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type_,
                "param": self.param,
                "code": self.status,
            }
        }
        return web.json_response(body, status=self.status)


def _bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, type_="BadRequestError", param=param)


def _internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, type_="InternalServerError")


def _control_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _drop_connection(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()


# -- middlewares -------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except ServerClosingError:
        # Like a server process going away: the client sees the connection close.
        _drop_connection(request)
        return web.Response(status=503)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # FastAPI's shape for routing errors (404 unknown path, 405 wrong method, 413).
        return web.json_response({"detail": exc.reason}, status=exc.status)


@web.middleware
async def _fault_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(CONTROL_PREFIX):
        return await handler(request)
    engine = request.app[ENGINE_KEY]
    if engine.faults.refuse:
        # The listener is closed; a keep-alive connection opened before must not be served either.
        _drop_connection(request)
        return web.Response(status=503)
    resource = request.match_info.route.resource
    if resource is not None:
        engine.requests_served[resource.canonical] += 1
    if engine.faults.hang:
        await engine.wait_while_hung()
    return await handler(request)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Like vLLM's AuthenticationMiddleware: OPTIONS and unguarded paths pass.
    api_key = request.app[ENGINE_KEY].config.api_key
    if (
        api_key is not None
        and request.method != "OPTIONS"
        and request.path.startswith(_GUARDED_PREFIXES)
        and request.headers.get("Authorization") != f"Bearer {api_key}"
    ):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


# -- request parsing ---------------------------------------------------------------------------


async def _read_recorded(request: web.Request, engine: Engine) -> bytes:
    body = await request.read()
    engine.record(
        RecordedRequest(
            method=request.method,
            path=request.path_qs,
            headers=tuple(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers
            ),
            body=body,
            received_at=time.time(),
        )
    )
    return body


def _parse_object(body: bytes) -> dict[str, object]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad_request(f"Invalid JSON body: {exc}") from exc
    if not isinstance(payload, dict):
        raise _bad_request("The request body must be a JSON object.")
    return payload


def _check_model(payload: Mapping[str, object], config: VllmSimConfig) -> None:
    model = payload.get("model")
    if model is None or model == "":
        return  # vLLM accepts an empty or missing model and serves the first name
    if not isinstance(model, str):
        raise _bad_request("model must be a string.", "model")
    if model not in config.served_model_names:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist. "
            f"Valid aliases: {', '.join(config.served_model_names)}.",
            type_="NotFoundError",
            param="model",
        )


def _optional_bool(payload: Mapping[str, object], key: str) -> bool:
    value = payload.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad_request(f"{key} must be a boolean.", key)
    return value


def _max_tokens(
    payload: Mapping[str, object], keys: Sequence[str], default: int | None
) -> int | None:
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad_request(f"{key} must be an integer.", key)
        if value < 1:
            raise _bad_request(f"max_tokens must be at least 1, got {value}.", key)
        return value
    return default


def _include_usage(payload: Mapping[str, object], *, stream: bool) -> bool:
    options = payload.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad_request("stream_options must be an object.", "stream_options")
    if not stream:
        raise _bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise _bad_request("stream_options.include_usage must be a boolean.", "stream_options")
    return bool(include)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def _chat_prompt(payload: Mapping[str, object]) -> tuple[list[str], int]:
    """Return (words to echo, prompt token count) for a chat request."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad_request("messages must be a non-empty list.", "messages")
    texts: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad_request("each message must be an object with a string role.", "messages")
        texts.append((message["role"], _content_text(message.get("content"))))
    user_texts = [text for role, text in texts if role == "user"]
    source = user_texts[-1] if user_texts else texts[-1][1]
    prompt_tokens = max(1, sum(len(text.split()) for _, text in texts))
    return source.split() or list(_FALLBACK_WORDS), prompt_tokens


def _prompts(payload: Mapping[str, object], key: str) -> list[str]:
    """Normalise an OpenAI prompt/input (str, [str], [int], [[int]]) to a list of texts."""
    value = payload.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [str(v) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [" ".join(str(v) for v in value)]
        if all(
            isinstance(v, list)
            and v
            and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            for v in value
        ):
            return [" ".join(str(t) for t in v) for v in value if isinstance(v, list)]
    raise _bad_request(f"{key} must be a string, a non-empty list of strings, or token ids.", key)


def _check_context(prompt_tokens: int, limit: int | None, config: VllmSimConfig) -> None:
    if prompt_tokens + (limit or 0) > config.max_model_len:
        raise _bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_tokens + (limit or 0)} tokens ({prompt_tokens} in the "
            f"messages, {limit or 0} in the completion). Please reduce the length of the "
            "messages or completion."
        )


def _plan(words: list[str], limit: int | None) -> tuple[list[str], str]:
    """Tokens to emit (a token = a word) and the natural finish reason."""
    if limit is not None and limit < len(words):
        return words[:limit], "length"
    return words, "stop"


def _pieces(tokens: Sequence[str]) -> list[str]:
    return [token if i == 0 else f" {token}" for i, token in enumerate(tokens)]


def _chat_plan(
    words: list[str], limit: int | None, config: VllmSimConfig
) -> tuple[list[tuple[str, str]], str]:
    """Chat pieces as (``"reasoning"`` | ``"content"``, text) and the natural finish reason.

    With a reasoning parser the answer starts with ``reasoning_tokens`` words of "thinking"
    (the prompt words, cycled); ``max_tokens`` counts them too, so a short answer can be all
    reasoning.
    """
    reasoning: list[str] = []
    if config.reasoning_field is not None:
        reasoning = [words[i % len(words)] for i in range(config.reasoning_tokens)]
    tokens, finish = _plan([*reasoning, *words], limit)
    thought, answer = tokens[: len(reasoning)], tokens[len(reasoning) :]
    return [
        *(("reasoning", piece) for piece in _pieces(thought)),
        *(("content", piece) for piece in _pieces(answer)),
    ], finish


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


# -- generation --------------------------------------------------------------------------------


async def _generate(
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


class _SseWriter:
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


async def _stream(
    request: web.Request,
    engine: Engine,
    produce: Callable[[_SseWriter], Awaitable[None]],
) -> web.StreamResponse:
    # vLLM returns a StreamingResponse before the engine produced anything, so the headers
    # go out at once, even while the request is parked behind a sleeping engine.
    writer = _SseWriter(request, engine.faults.cut_stream_after_chunks)
    try:
        await writer.start()
        await produce(writer)
        await writer.send("[DONE]")
    except _StreamCutError:
        logger.info("cut_stream_after_chunks: closing %s mid-stream", request.path)
        _drop_connection(request)
    except ServerClosingError:
        _drop_connection(request)
    except ConnectionError:
        logger.info("client of %s went away mid-stream", request.path)
    return writer.response


# -- inference routes --------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    body = await _read_recorded(request, engine)
    if engine.faults.error_500:
        raise _internal("simulated internal server error")
    payload = _parse_object(body)
    _check_model(payload, config)
    words, prompt_tokens = _chat_prompt(payload)
    limit = _max_tokens(payload, ("max_completion_tokens", "max_tokens"), None)
    stream = _optional_bool(payload, "stream")
    include_usage = _include_usage(payload, stream=stream)
    _check_context(prompt_tokens, limit, config)
    pieces, natural_finish = _chat_plan(words, limit, config)
    chat_id, created = _new_id("chatcmpl"), int(time.time())
    engine.note_arrival()

    def head(object_: str) -> dict[str, object]:
        return {
            "id": chat_id,
            "object": object_,
            "created": created,
            "model": config.primary_model_name,
        }

    reasoning_field = config.reasoning_field
    if not stream:
        parts: dict[str, list[str]] = {"content": [], "reasoning": []}

        async def collect(piece: tuple[str, str]) -> None:
            parts[piece[0]].append(piece[1])

        emitted, finish = await _generate(engine, pieces, natural_finish, collect)
        message: dict[str, object] = {"role": "assistant", "content": "".join(parts["content"])}
        if reasoning_field is not None:
            # vLLM's reasoning parsers leave content null when no answer followed the thinking
            # (vllm/reasoning/basic_parsers.py).
            message["content"] = "".join(parts["content"]) or None
            message[reasoning_field] = "".join(parts["reasoning"]) or None
        message.update({"refusal": None, "tool_calls": []})
        return web.json_response(
            {
                **head("chat.completion"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "usage": _usage(prompt_tokens, emitted),
            }
        )

    def chunk(delta: Mapping[str, object], finish_reason: str | None) -> dict[str, object]:
        return {
            **head("chat.completion.chunk"),
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    async def produce(writer: _SseWriter) -> None:
        role_sent = False

        async def emit(piece: tuple[str, str]) -> None:
            nonlocal role_sent
            if not role_sent:
                role_sent = True
                await writer.send(chunk({"role": "assistant", "content": ""}, None))
            kind, text = piece
            key = "content" if kind == "content" else (reasoning_field or "reasoning")
            await writer.send(chunk({key: text}, None))

        emitted, finish = await _generate(engine, pieces, natural_finish, emit)
        if not role_sent:
            await writer.send(chunk({"role": "assistant", "content": ""}, None))
        await writer.send(chunk({}, finish))
        if include_usage:
            await writer.send(
                {
                    **head("chat.completion.chunk"),
                    "choices": [],
                    "usage": _usage(prompt_tokens, emitted),
                }
            )

    return await _stream(request, engine, produce)


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    body = await _read_recorded(request, engine)
    if engine.faults.error_500:
        raise _internal("simulated internal server error")
    payload = _parse_object(body)
    _check_model(payload, config)
    prompts = _prompts(payload, "prompt")
    limit = _max_tokens(payload, ("max_tokens",), _COMPLETIONS_DEFAULT_MAX_TOKENS)
    stream = _optional_bool(payload, "stream")
    include_usage = _include_usage(payload, stream=stream)
    prompt_words = [prompt.split() for prompt in prompts]
    prompt_tokens = sum(max(1, len(words)) for words in prompt_words)
    for words in prompt_words:
        _check_context(max(1, len(words)), limit, config)
    plans = [_plan(words or list(_FALLBACK_WORDS), limit) for words in prompt_words]
    engine.note_arrival()
    base = {
        "id": _new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": config.primary_model_name,
    }

    def choice(index: int, text: str, finish_reason: str | None) -> dict[str, object]:
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }

    if not stream:
        choices: list[dict[str, object]] = []
        completion_tokens = 0
        for index, (tokens, natural_finish) in enumerate(plans):
            parts: list[str] = []

            async def collect(piece: str, parts: list[str] = parts) -> None:
                parts.append(piece)

            emitted, finish = await _generate(engine, _pieces(tokens), natural_finish, collect)
            completion_tokens += emitted
            choices.append(choice(index, "".join(parts), finish))
        return web.json_response(
            {**base, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}
        )

    async def produce(writer: _SseWriter) -> None:
        completion_tokens = 0
        for index, (tokens, natural_finish) in enumerate(plans):

            async def emit(piece: str, index: int = index) -> None:
                await writer.send({**base, "choices": [choice(index, piece, None)]})

            emitted, finish = await _generate(engine, _pieces(tokens), natural_finish, emit)
            completion_tokens += emitted
            await writer.send({**base, "choices": [choice(index, "", finish)]})
        if include_usage:
            await writer.send(
                {**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
            )

    return await _stream(request, engine, produce)


def embedding_vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector derived from ``text`` (same text, same vector)."""
    raw = b""
    counter = 0
    while len(raw) < 4 * dimensions:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    values = [
        (int.from_bytes(raw[4 * i : 4 * i + 4], "big") / 0xFFFFFFFF) * 2 - 1
        for i in range(dimensions)
    ]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    # Rounded to float32 so the float and base64 encodings carry the same numbers.
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in values]


async def embeddings(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    body = await _read_recorded(request, engine)
    if engine.faults.error_500:
        raise _internal("simulated internal server error")
    payload = _parse_object(body)
    _check_model(payload, config)
    inputs = _prompts(payload, "input")
    encoding = payload.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _bad_request("encoding_format must be 'float' or 'base64'.", "encoding_format")
    dimensions = payload.get("dimensions")
    if dimensions is not None and dimensions != config.embedding_dimensions:
        raise _bad_request(
            "Model does not support matryoshka representation, "
            "changing output dimensions will lead to poor results.",
            "dimensions",
        )
    prompt_tokens = sum(max(1, len(text.split())) for text in inputs)
    engine.note_arrival()

    async def no_emit(_piece: str) -> None:
        return None

    # One paced step stands for the forward pass; it parks while asleep like any request.
    _, finish = await _generate(engine, [""], "stop", no_emit)
    if finish == "abort":
        raise _internal("The request was aborted.")
    data: list[dict[str, object]] = []
    for index, text in enumerate(inputs):
        vector = embedding_vector(text, config.embedding_dimensions)
        embedding: list[float] | str = vector
        if encoding == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    return web.json_response(
        {
            "id": _new_id("embd"),
            "object": "list",
            "created": int(time.time()),
            "model": config.primary_model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )


# -- always-on routes --------------------------------------------------------------------------


async def models(request: web.Request) -> web.StreamResponse:
    config = request.app[ENGINE_KEY].config
    created = int(time.time())
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": config.model_root,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [
                {
                    "id": _new_id("modelperm"),
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in config.served_model_names
    ]
    return web.json_response({"object": "list", "data": cards})


async def health(_request: web.Request) -> web.StreamResponse:
    # 200 with an empty body, also while asleep: /health proves liveness, not wakefulness.
    return web.Response(status=200)


async def version(request: web.Request) -> web.StreamResponse:
    # Always served (vllm/entrypoints/serve/instrumentator/basic.py).
    return web.json_response({"version": request.app[ENGINE_KEY].config.vllm_version})


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


async def metrics(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    if not engine.config.log_stats:
        # --disable-log-stats: no PrometheusStatLogger, so no vllm:* metric at all; the
        # route still serves the process collectors.
        text = (
            "# HELP python_info Python platform information\n"
            "# TYPE python_info gauge\n"
            'python_info{implementation="CPython"} 1.0\n'
        )
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE})
    model = _label(engine.config.primary_model_name)
    labels = f'engine="0",model_name="{model}"'
    level = engine.sleep_level
    sleep_state = {None: "awake", 0: "awake", 1: "weights_offloaded", 2: "discard_all"}[level]
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(engine.gauge_running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(engine.gauge_waiting)}",
        "# HELP vllm:engine_sleep_state Engine sleep state (1 for the current state).",
        "# TYPE vllm:engine_sleep_state gauge",
    ]
    for state in ("awake", "weights_offloaded", "discard_all"):
        value = 1.0 if state == sleep_state else 0.0
        lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{state}"}} {value}')
    lines += [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "abort"):
        count = float(engine.finished[reason])
        lines.append(
            f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
            f'model_name="{model}"}} {count}'
        )
    return web.Response(
        body=("\n".join(lines) + "\n").encode(),
        headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE},
    )


# -- dev-mode admin routes ---------------------------------------------------------------------


def _query_level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    if not _INT_RE.fullmatch(raw.strip()):
        raise _bad_request(f"level: Input should be a valid integer, got {raw!r}.", "level")
    level = int(raw)
    if not 0 <= level <= 2:
        raise _bad_request(f"level: Input should be between 0 and 2, got {level}.", "level")
    return level


def _query_mode(request: web.Request) -> SleepMode:
    raw = request.query.get("mode", "abort")
    for mode in SLEEP_MODES:
        if raw == mode:
            return mode
    raise _bad_request(f"mode: Input should be 'abort', 'wait' or 'keep', got {raw!r}.", "mode")


async def sleep(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    level = _query_level(request)
    # Before 0.17 there is no mode parameter: it is neither validated nor used.
    mode: SleepMode = _query_mode(request) if engine.config.sleep_pauses else "abort"
    try:
        await engine.run_detached(engine.sleep(level, mode))
    except SimulatedFaultError as exc:
        raise _internal(str(exc)) from exc
    if not engine.config.admin_json_bodies:
        return web.Response(status=200)
    return web.json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    tags = request.query.getall("tags", []) or None
    try:
        fully_awake = await engine.run_detached(engine.wake_up(tags))
    except SimulatedFaultError as exc:
        raise _internal(str(exc)) from exc
    if not engine.config.admin_json_bodies:
        return web.Response(status=200)
    return web.json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})


async def is_sleeping(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    if engine.faults.is_sleeping_garbage:
        return web.json_response({"is_sleeping": "unknown"})
    # Answered by the engine loop: no answer while a sleep or wake runs in it.
    return web.json_response({"is_sleeping": await engine.is_sleeping_answer()})


# -- control routes (the sim's own, never part of vLLM) ----------------------------------------


async def control_state(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[ENGINE_KEY].state_json())


async def control_get_faults(request: web.Request) -> web.StreamResponse:
    return web.json_response({"faults": request.app[ENGINE_KEY].faults.to_json()})


async def control_set_faults(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        changes = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return _control_error(400, "invalid_request", "the body must be a JSON object of faults")
    if not isinstance(changes, dict):
        return _control_error(400, "invalid_request", "the body must be a JSON object of faults")
    try:
        faults = await engine.set_faults(engine.faults.updated(changes))
    except SimConfigError as exc:
        return _control_error(400, "invalid_request", str(exc))
    except SimUnsupportedError as exc:
        return _control_error(409, "unsupported", str(exc))
    return web.json_response({"faults": faults.to_json()})


async def control_clear_faults(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        faults = await engine.set_faults(type(engine.faults)())
    except SimUnsupportedError as exc:  # refuse is only ever on with a listener; kept for safety
        return _control_error(409, "unsupported", str(exc))
    return web.json_response({"faults": faults.to_json()})


async def control_requests(request: web.Request) -> web.StreamResponse:
    recorded = request.app[ENGINE_KEY].recorded_requests
    return web.json_response(
        {
            "requests": [
                {
                    "method": r.method,
                    "path": r.path,
                    "headers": [list(h) for h in r.headers],
                    "body_base64": base64.b64encode(r.body).decode(),
                    "received_at": r.received_at,
                }
                for r in recorded
            ]
        }
    )


async def control_clear_requests(request: web.Request) -> web.StreamResponse:
    request.app[ENGINE_KEY].clear_recorded()
    return web.json_response({"requests": []})


# -- assembly ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    method: str
    path: str
    handler: Handler


CONTROL_ROUTES: Final = (
    _Route("GET", "/_sim/state", control_state),
    _Route("GET", "/_sim/faults", control_get_faults),
    _Route("POST", "/_sim/faults", control_set_faults),
    _Route("DELETE", "/_sim/faults", control_clear_faults),
    _Route("GET", "/_sim/requests", control_requests),
    _Route("DELETE", "/_sim/requests", control_clear_requests),
)


def _add(app: web.Application, routes: Sequence[_Route]) -> None:
    for route in routes:
        app.router.add_route(route.method, route.path, route.handler)


async def _close_engine(app: web.Application) -> None:
    # on_shutdown runs before aiohttp waits for handlers: release parked and hung requests.
    app[ENGINE_KEY].close()


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    app[ENGINE_KEY].start_stepping()
    yield
    engine = app[ENGINE_KEY]
    engine.close()
    await engine.wait_detached()


def build_app(engine: Engine, *, control_only: bool = False) -> web.Application:
    """Assemble the aiohttp app around ``engine`` (``control_only``: just ``/_sim/*``)."""
    app = web.Application(
        middlewares=[_error_middleware, _fault_middleware, _auth_middleware],
        client_max_size=_MAX_BODY_BYTES,
    )
    app[ENGINE_KEY] = engine
    app.on_shutdown.append(_close_engine)
    app.cleanup_ctx.append(_engine_ctx)
    _add(app, CONTROL_ROUTES)
    if control_only:
        return app
    _add(
        app,
        (
            _Route("POST", CHAT_PATH, chat_completions),
            _Route("POST", COMPLETIONS_PATH, completions),
            _Route("POST", EMBEDDINGS_PATH, embeddings),
            _Route("GET", "/v1/models", models),
            _Route("GET", "/health", health),
            _Route("GET", "/metrics", metrics),
            _Route("GET", "/version", version),
        ),
    )
    if engine.config.dev_mode:
        _add(
            app,
            (
                _Route("POST", "/sleep", sleep),
                _Route("POST", "/wake_up", wake_up),
                _Route("GET", "/is_sleeping", is_sleeping),
            ),
        )
    return app


def create_vllm_app(config: VllmSimConfig | None = None) -> web.Application:
    """Build an emulated vLLM server as an aiohttp app (for ``aiohttp_client``/``aiohttp_server``).

    Faults are set through ``POST /_sim/faults``. The ``refuse`` fault is unavailable here
    (answered 409): closing the listener needs a server started by :class:`VllmSim`.

    Args:
        config: The server's configuration; defaults to ``VllmSimConfig()``.

    Returns:
        A fresh, unstarted application.
    """
    return build_app(Engine(config if config is not None else VllmSimConfig()))
