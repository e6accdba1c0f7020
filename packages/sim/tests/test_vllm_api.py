"""OpenAI routes of the emulated vLLM server, over a real socket."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_sim import VllmSim, VllmSimConfig, create_vllm_app, embedding_vector

# Fixture types (conftest.py cannot be imported under --import-mode=importlib).
StartSim = Callable[..., Awaitable[VllmSim]]
ReadSse = Callable[[aiohttp.ClientResponse], AsyncIterator[Any]]


def chat_body(content: str = "hello brave new world", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def test_chat_json_echoes_the_last_user_message(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(served_model_names=("chat-small", "alias"))
    body = {
        "model": "alias",
        "messages": [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": [{"type": "text", "text": "alpha beta"}]},
        ],
    }
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert isinstance(data["created"], int)
    # Like vLLM, responses carry the first served name whichever alias was asked for.
    assert data["model"] == "chat-small"
    [choice] = data["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "alpha beta"
    assert choice["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_chat_is_bounded_by_max_tokens(
    start_sim: StartSim, http: aiohttp.ClientSession, key: str
) -> None:
    sim = await start_sim()
    body = chat_body()
    body[key] = 2
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
    assert data["choices"][0]["message"]["content"] == "hello brave"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2


async def test_chat_content_is_never_empty(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    async with http.post(
        f"{sim.url}/v1/chat/completions", json=chat_body("   ", max_tokens=1)
    ) as resp:
        data = await resp.json()
    assert data["choices"][0]["message"]["content"]


async def test_chat_stream_arrives_incrementally(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim(token_latency_ms=200.0)
    body = chat_body("one two three", stream=True, stream_options={"include_usage": True})
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = []
        async for event in read_sse(resp):
            events.append(event)
            if len(events) == 2:
                # The first token reached the client while the server was still generating.
                assert sim.num_running == 1
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(pieces) == "one two three"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert sim.num_running == 0


@pytest.mark.parametrize("model", [None, ""])
async def test_missing_or_empty_model_uses_the_first_name(
    start_sim: StartSim, http: aiohttp.ClientSession, model: str | None
) -> None:
    sim = await start_sim(served_model_names=("first", "second"))
    body = chat_body() if model is None else chat_body(model=model)
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "first"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("model", ["First", "first ", "unknown"])
async def test_unknown_model_is_a_vllm_404(
    start_sim: StartSim, http: aiohttp.ClientSession, path: str, model: str
) -> None:
    sim = await start_sim(served_model_names=("first", "second"))
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    body["input"] = "x"
    async with http.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == 404
        data = await resp.json()
    assert data == {
        "error": {
            "message": f"The model `{model}` does not exist. Valid aliases: first, second.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "Invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"content": "no role"}]}', "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "at least 1"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "4"}', "integer"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "boolean"),
        (b'{"messages": [{"role": "user", "content": "x"}], "model": 7}', "string"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
            "stream=True",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999}', "context"),
    ],
)
async def test_bad_chat_requests_are_400(
    start_sim: StartSim, http: aiohttp.ClientSession, raw: bytes, fragment: str
) -> None:
    sim = await start_sim()
    async with http.post(
        f"{sim.url}/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        data = await resp.json()
    assert data["error"]["type"] == "BadRequestError"
    assert data["error"]["code"] == 400
    assert fragment in data["error"]["message"]


async def test_unknown_fields_are_accepted_and_bodies_recorded_byte_for_byte(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(request_log_size=2)
    raw = (
        b'{ "messages":[{"role":"user","content":"caf\xc3\xa9 ok"}],'
        b'  "vendor_extension": {"x": [1, 2.50]}, "top_k" : 3 }'
    )
    for _ in range(3):
        async with http.post(
            f"{sim.url}/v1/chat/completions?trace=1",
            data=raw,
            headers={"Content-Type": "application/json", "X-Request-Id": "abc"},
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "café ok"
    recorded = sim.recorded_requests
    assert len(recorded) == 2  # bounded
    assert recorded[-1].body == raw
    assert recorded[-1].method == "POST"
    assert recorded[-1].path == "/v1/chat/completions?trace=1"
    assert ("x-request-id", "abc") in [(k.lower(), v) for k, v in recorded[-1].headers]
    sim.clear_recorded_requests()
    assert sim.recorded_requests == ()


async def test_completions_json_and_stream(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim(served_model_names=("base",))
    async with http.post(
        f"{sim.url}/v1/completions",
        json={"model": "base", "prompt": ["a b c", "d e"], "max_tokens": 2},
    ) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in data["choices"]] == [
        (0, "a b", "length"),
        (1, "d e", "stop"),
    ]
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}

    body = {"prompt": "x y", "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
        events = [e async for e in read_sse(resp)]
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "x y"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 2


async def test_completions_default_to_16_tokens_and_accept_token_ids(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    prompt = " ".join(f"w{i}" for i in range(20))
    async with http.post(f"{sim.url}/v1/completions", json={"prompt": prompt}) as resp:
        data = await resp.json()
    assert len(data["choices"][0]["text"].split()) == 16
    async with http.post(f"{sim.url}/v1/completions", json={"prompt": [[1, 2], [3]]}) as resp:
        data = await resp.json()
    assert [c["text"] for c in data["choices"]] == ["1 2", "3"]
    async with http.post(f"{sim.url}/v1/completions", json={"prompt": []}) as resp:
        assert resp.status == 400


async def test_embeddings_are_deterministic_in_float_and_base64(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(embedding_dimensions=8)
    async with http.post(f"{sim.url}/v1/embeddings", json={"input": ["a", "b", "a"]}) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "list"
    vectors = [d["embedding"] for d in data["data"]]
    assert [d["index"] for d in data["data"]] == [0, 1, 2]
    assert all(len(v) == 8 for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    assert vectors[0] == embedding_vector("a", 8)
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-5
    assert data["usage"] == {"prompt_tokens": 3, "total_tokens": 3}

    async with http.post(
        f"{sim.url}/v1/embeddings", json={"input": "a", "encoding_format": "base64"}
    ) as resp:
        data = await resp.json()
    decoded = struct.unpack("<8f", base64.b64decode(data["data"][0]["embedding"]))
    assert list(decoded) == vectors[0]

    for bad in (
        {"input": "a", "encoding_format": "hex"},
        {"input": 5},
        {"input": "a", "dimensions": 3},
    ):
        async with http.post(f"{sim.url}/v1/embeddings", json=bad) as resp:
            assert resp.status == 400


async def test_models_lists_every_served_name(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(served_model_names=("a", "b"), model="/models/a", max_model_len=2048)
    async with http.get(f"{sim.url}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["a", "b"]
    for card in data["data"]:
        assert card["object"] == "model"
        assert card["owned_by"] == "vllm"
        assert card["root"] == "/models/a"
        assert card["max_model_len"] == 2048
        assert isinstance(card["created"], int)


async def test_health_metrics_and_fastapi_404(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(served_model_names=('m"x',))
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
    async with http.get(f"{sim.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    assert 'vllm:num_requests_running{engine="0",model_name="m\\"x"} 0.0' in text
    assert 'vllm:num_requests_waiting{engine="0",model_name="m\\"x"} 0.0' in text
    assert "# TYPE vllm:num_requests_running gauge" in text
    async with http.get(f"{sim.url}/nope") as resp:
        assert resp.status == 404
        assert await resp.json() == {"detail": "Not Found"}
    async with http.get(f"{sim.url}/v1/chat/completions") as resp:
        assert resp.status == 405
        assert await resp.json() == {"detail": "Method Not Allowed"}
    assert sim.requests_served["/health"] == 1
    assert sim.requests_served["/metrics"] == 1


async def test_create_vllm_app_serves_through_aiohttp_client(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_vllm_app(VllmSimConfig(served_model_names=("m",))))
    resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "hello"
    resp = await client.get("/_sim/requests")
    [recorded] = (await resp.json())["requests"]
    assert json.loads(base64.b64decode(recorded["body_base64"])) == chat_body(max_tokens=1)
    assert (await client.delete("/_sim/requests")).status == 200
    assert (await (await client.get("/_sim/requests")).json()) == {"requests": []}
