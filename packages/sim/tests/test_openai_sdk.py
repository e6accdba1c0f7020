"""The official ``openai`` SDK parses every response of the emulated server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from haru_sim import VllmSim, VllmSimConfig, embedding_vector


@pytest.fixture
async def sim() -> AsyncIterator[VllmSim]:
    async with VllmSim(VllmSimConfig(served_model_names=("example-chat-small", "alias"))) as sim:
        yield sim


@pytest.fixture
async def client(sim: VllmSim) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{sim.url}/v1", api_key="not-checked", max_retries=0, timeout=15
    ) as client:
        yield client


async def test_chat(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="alias",
        messages=[{"role": "user", "content": "ping pong"}],
        max_tokens=4,
        extra_body={"top_k": 5},  # a vLLM extension rides along
    )
    assert completion.model == "example-chat-small"
    assert completion.choices[0].message.content == "ping pong"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 2


async def test_chat_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="example-chat-small",
        messages=[{"role": "user", "content": "a b c"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish_reasons: list[str] = []
    usage_tokens: list[int] = []
    async for chunk in stream:
        if chunk.usage is not None:
            usage_tokens.append(chunk.usage.completion_tokens)
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert "".join(pieces) == "a b c"
    assert finish_reasons == ["stop"]
    assert usage_tokens == [3]


async def test_unknown_model_is_not_found(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(
            model="Example-Chat-Small", messages=[{"role": "user", "content": "x"}]
        )
    assert "does not exist" in str(caught.value)


async def test_completions(client: openai.AsyncOpenAI) -> None:
    completion = await client.completions.create(
        model="example-chat-small", prompt="one two three", max_tokens=2
    )
    assert completion.choices[0].text == "one two"
    assert completion.choices[0].finish_reason == "length"
    stream = await client.completions.create(model="example-chat-small", prompt="x y", stream=True)
    assert "".join([chunk.choices[0].text async for chunk in stream]) == "x y"


async def test_embeddings(client: openai.AsyncOpenAI) -> None:
    # The SDK asks for base64 unless told otherwise; try both encodings.
    default = await client.embeddings.create(model="example-chat-small", input=["a", "b"])
    floats = await client.embeddings.create(
        model="example-chat-small", input="a", encoding_format="float"
    )
    assert [len(d.embedding) for d in default.data] == [8, 8]
    assert default.data[0].embedding == floats.data[0].embedding == embedding_vector("a", 8)
    assert default.usage.prompt_tokens == 2


async def test_models(client: openai.AsyncOpenAI) -> None:
    page = await client.models.list()
    assert [m.id for m in page.data] == ["example-chat-small", "alias"]
    assert {m.owned_by for m in page.data} == {"vllm"}
