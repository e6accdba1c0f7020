"""The emulated vLLM's OpenAI routes: chat completions, completions, embeddings and models.

Each request is recorded, validated like vLLM 0.33 (exact case-sensitive model names, its
error messages), then answered by echoing prompt words at the configured pace, as one JSON
body or as SSE.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from collections.abc import Mapping
from typing import Final

from aiohttp import web

from haru_sim._engine import Engine
from haru_sim._vllm_http import ENGINE_KEY, bad_request, internal_error, new_id
from haru_sim._vllm_parse import (
    FALLBACK_WORDS,
    chat_plan,
    chat_prompt,
    check_context,
    check_model,
    max_tokens,
    optional_bool,
    parse_object,
    prompt_texts,
    read_recorded,
    spaced_pieces,
    token_plan,
    usage,
    wants_usage,
)
from haru_sim._vllm_sse import SseWriter, generate, sse_response

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
EMBEDDINGS_PATH: Final = "/v1/embeddings"
_COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions


async def _accepted(request: web.Request) -> tuple[Engine, dict[str, object]]:
    """The engine and the request's parsed body, once recorded and accepted.

    Refused as vLLM would: the 500 fault, a body that is not a JSON object, a model this
    server does not serve.
    """
    engine = request.app[ENGINE_KEY]
    body = await read_recorded(request, engine)
    if engine.faults.error_500:
        raise internal_error("simulated internal server error")
    payload = parse_object(body)
    check_model(payload, engine.config)
    return engine, payload


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, payload = await _accepted(request)
    config = engine.config
    words, prompt_tokens = chat_prompt(payload)
    limit = max_tokens(payload, ("max_completion_tokens", "max_tokens"), None)
    stream = optional_bool(payload, "stream")
    include_usage = wants_usage(payload, stream=stream)
    check_context(prompt_tokens, limit, config)
    pieces, natural_finish = chat_plan(words, limit, config)
    chat_id, created = new_id("chatcmpl"), int(time.time())
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

        emitted, finish = await generate(engine, pieces, natural_finish, collect)
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
                "usage": usage(prompt_tokens, emitted),
            }
        )

    def chunk(delta: Mapping[str, object], finish_reason: str | None) -> dict[str, object]:
        return {
            **head("chat.completion.chunk"),
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    async def produce(writer: SseWriter) -> None:
        role_sent = False

        async def emit(piece: tuple[str, str]) -> None:
            nonlocal role_sent
            if not role_sent:
                role_sent = True
                await writer.send(chunk({"role": "assistant", "content": ""}, None))
            kind, text = piece
            key = "content" if kind == "content" else (reasoning_field or "reasoning")
            await writer.send(chunk({key: text}, None))

        emitted, finish = await generate(engine, pieces, natural_finish, emit)
        if not role_sent:
            await writer.send(chunk({"role": "assistant", "content": ""}, None))
        await writer.send(chunk({}, finish))
        if include_usage:
            await writer.send(
                {
                    **head("chat.completion.chunk"),
                    "choices": [],
                    "usage": usage(prompt_tokens, emitted),
                }
            )

    return await sse_response(request, engine, produce)


async def completions(request: web.Request) -> web.StreamResponse:
    engine, payload = await _accepted(request)
    config = engine.config
    prompts = prompt_texts(payload, "prompt")
    limit = max_tokens(payload, ("max_tokens",), _COMPLETIONS_DEFAULT_MAX_TOKENS)
    stream = optional_bool(payload, "stream")
    include_usage = wants_usage(payload, stream=stream)
    prompt_words = [prompt.split() for prompt in prompts]
    prompt_tokens = sum(max(1, len(words)) for words in prompt_words)
    for words in prompt_words:
        check_context(max(1, len(words)), limit, config)
    plans = [token_plan(words or list(FALLBACK_WORDS), limit) for words in prompt_words]
    engine.note_arrival()
    base = {
        "id": new_id("cmpl"),
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

            emitted, finish = await generate(engine, spaced_pieces(tokens), natural_finish, collect)
            completion_tokens += emitted
            choices.append(choice(index, "".join(parts), finish))
        return web.json_response(
            {**base, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        )

    async def produce(writer: SseWriter) -> None:
        completion_tokens = 0
        for index, (tokens, natural_finish) in enumerate(plans):

            async def emit(piece: str, index: int = index) -> None:
                await writer.send({**base, "choices": [choice(index, piece, None)]})

            emitted, finish = await generate(engine, spaced_pieces(tokens), natural_finish, emit)
            completion_tokens += emitted
            await writer.send({**base, "choices": [choice(index, "", finish)]})
        if include_usage:
            await writer.send(
                {**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
            )

    return await sse_response(request, engine, produce)


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
    engine, payload = await _accepted(request)
    config = engine.config
    inputs = prompt_texts(payload, "input")
    encoding = payload.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'.", "encoding_format")
    dimensions = payload.get("dimensions")
    if dimensions is not None and dimensions != config.embedding_dimensions:
        raise bad_request(
            "Model does not support matryoshka representation, "
            "changing output dimensions will lead to poor results.",
            "dimensions",
        )
    prompt_tokens = sum(max(1, len(text.split())) for text in inputs)
    engine.note_arrival()

    async def no_emit(_piece: str) -> None:
        return None

    # One paced step stands for the forward pass; it parks while asleep like any request.
    _, finish = await generate(engine, [""], "stop", no_emit)
    if finish == "abort":
        raise internal_error("The request was aborted.")
    data: list[dict[str, object]] = []
    for index, text in enumerate(inputs):
        vector = embedding_vector(text, config.embedding_dimensions)
        embedding: list[float] | str = vector
        if encoding == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    return web.json_response(
        {
            "id": new_id("embd"),
            "object": "list",
            "created": int(time.time()),
            "model": config.primary_model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )


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
                    "id": new_id("modelperm"),
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


INFERENCE_ROUTES: Final = (
    web.route("POST", CHAT_PATH, chat_completions),
    web.route("POST", COMPLETIONS_PATH, completions),
    web.route("POST", EMBEDDINGS_PATH, embeddings),
    web.route("GET", "/v1/models", models),
)
