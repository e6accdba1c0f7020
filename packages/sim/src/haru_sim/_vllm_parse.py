"""Request parsing for the emulated vLLM: the body, field checks and the plan of the answer.

Checks and messages follow vLLM 0.33; a token is a word of the prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Final

from aiohttp import web

from haru_sim._config import VllmSimConfig
from haru_sim._engine import Engine, RecordedRequest
from haru_sim._vllm_http import OpenAIError, bad_request

FALLBACK_WORDS: Final = ("ok",)


async def read_recorded(request: web.Request, engine: Engine) -> bytes:
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


def parse_object(body: bytes) -> dict[str, object]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from exc
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.")
    return payload


def check_model(payload: Mapping[str, object], config: VllmSimConfig) -> None:
    model = payload.get("model")
    if model is None or model == "":
        return  # vLLM accepts an empty or missing model and serves the first name
    if not isinstance(model, str):
        raise bad_request("model must be a string.", "model")
    if model not in config.served_model_names:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist. "
            f"Valid aliases: {', '.join(config.served_model_names)}.",
            type_="NotFoundError",
            param="model",
        )


def optional_bool(payload: Mapping[str, object], key: str) -> bool:
    value = payload.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean.", key)
    return value


def max_tokens(
    payload: Mapping[str, object], keys: Sequence[str], default: int | None
) -> int | None:
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{key} must be an integer.", key)
        if value < 1:
            raise bad_request(f"max_tokens must be at least 1, got {value}.", key)
        return value
    return default


def wants_usage(payload: Mapping[str, object], *, stream: bool) -> bool:
    options = payload.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object.", "stream_options")
    if not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be a boolean.", "stream_options")
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


def chat_prompt(payload: Mapping[str, object]) -> tuple[list[str], int]:
    """Return (words to echo, prompt token count) for a chat request."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list.", "messages")
    texts: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a string role.", "messages")
        texts.append((message["role"], _content_text(message.get("content"))))
    user_texts = [text for role, text in texts if role == "user"]
    source = user_texts[-1] if user_texts else texts[-1][1]
    prompt_tokens = max(1, sum(len(text.split()) for _, text in texts))
    return source.split() or list(FALLBACK_WORDS), prompt_tokens


def prompt_texts(payload: Mapping[str, object], key: str) -> list[str]:
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
    raise bad_request(f"{key} must be a string, a non-empty list of strings, or token ids.", key)


def check_context(prompt_tokens: int, limit: int | None, config: VllmSimConfig) -> None:
    if prompt_tokens + (limit or 0) > config.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_tokens + (limit or 0)} tokens ({prompt_tokens} in the "
            f"messages, {limit or 0} in the completion). Please reduce the length of the "
            "messages or completion."
        )


def token_plan(words: list[str], limit: int | None) -> tuple[list[str], str]:
    """Tokens to emit (a token = a word) and the natural finish reason."""
    if limit is not None and limit < len(words):
        return words[:limit], "length"
    return words, "stop"


def spaced_pieces(tokens: Sequence[str]) -> list[str]:
    return [token if i == 0 else f" {token}" for i, token in enumerate(tokens)]


def chat_plan(
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
    tokens, finish = token_plan([*reasoning, *words], limit)
    thought, answer = tokens[: len(reasoning)], tokens[len(reasoning) :]
    return [
        *(("reasoning", piece) for piece in spaced_pieces(thought)),
        *(("content", piece) for piece in spaced_pieces(answer)),
    ], finish


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
