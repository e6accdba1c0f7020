"""``GET /readyz``: config, GPU memory source and local vLLM servers, on real sockets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from haru_sim import VllmSim


def _smi(directory: Path, *, exit_code: int = 0) -> str:
    """A real ``nvidia-smi`` executable on a search path: two GPUs, or a failure."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "print('0, 1024, 81920')\n"
        "print('1, 2048, 81920')\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return str(directory)


def _config(*sims: VllmSim) -> dict[str, Any]:
    models = [{"name": s.config.primary_model_name, "port": s.port} for s in sims]
    return {"slots": [{"kind": "inference", "gpuIndex": 0, "models": models}]}


async def _not_ready(response: Any) -> str:
    assert response.status == 503
    body = await response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == "not_ready"
    message: str = body["error"]["message"]
    return message


async def test_ready_with_a_gpu_source_and_answering_servers_asleep_or_awake(
    supervisor: Any, sims: Any, tmp_path: Path
) -> None:
    awake, asleep = await sims("chat-a"), await sims("chat-b")
    await asleep.sleep(1)
    client = await supervisor(
        _config(awake, asleep), gpu_source="nvidia-smi", search_path=_smi(tmp_path / "bin")
    )
    response = await client.get("/readyz")  # open, like /healthz
    assert response.status == 200
    assert await response.json() == {
        "ready": True,
        "checks": ["config", "GPU memory source", "vLLM servers"],
    }


async def test_not_ready_while_a_vllm_server_does_not_answer(
    supervisor: Any, sims: Any, tmp_path: Path
) -> None:
    up, down = await sims("chat-a"), await sims("chat-b")
    client = await supervisor(
        _config(up, down), gpu_source="nvidia-smi", search_path=_smi(tmp_path / "bin")
    )
    await down.set_faults(refuse=True)  # also drops the supervisor's pooled connection
    message = await _not_ready(await client.get("/readyz"))
    assert message == f"not ready: 1 of 2 vLLM server(s) do not answer: chat-b (port {down.port})"
    assert (await client.get("/healthz")).status == 200
    await down.set_faults(refuse=False)
    assert (await client.get("/readyz")).status == 200


async def test_not_ready_without_a_gpu_source(supervisor: Any, sims: Any) -> None:
    client = await supervisor(_config(await sims("chat-a")), search_path="")
    message = await _not_ready(await client.get("/readyz"))
    assert message.startswith("not ready: GPU memory source: GPU introspection is not configured")


async def test_not_ready_when_the_gpu_source_fails(
    supervisor: Any, sims: Any, tmp_path: Path
) -> None:
    client = await supervisor(
        _config(await sims("chat-a")),
        gpu_source="nvidia-smi",
        search_path=_smi(tmp_path / "bin", exit_code=3),
    )
    message = await _not_ready(await client.get("/readyz"))
    assert message.startswith("not ready: GPU memory source: ")
