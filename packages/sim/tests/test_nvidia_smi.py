"""``haru-sim-nvidia-smi``: a real ``haru-supervisor`` reads GPU memory and processes through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from haru_sim.nvidia_smi import CONTEXT_MIB, GPU_TOTAL_MIB, TRAINER_MIB, EmulatedGpu, dump_gpus

needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="trainers are found in /proc")

_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:([0-9]+)")


def _script(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found is not None, f"the {name} console script is not installed"
    return found


def test_without_a_gpu_document_it_reports_one_idle_gpu() -> None:
    done = subprocess.run(
        [_script("haru-sim-nvidia-smi"), "--query-gpu=index,uuid", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0, GPU-00000000-0000-4000-8000-000000000000\n"
    refused = subprocess.run(
        [_script("haru-sim-nvidia-smi"), "-L"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "--query-compute-apps=pid,gpu_uuid,used_memory" in refused.stderr


@contextlib.asynccontextmanager
async def _supervisor(env: dict[str, str]) -> AsyncIterator[str]:
    process = await asyncio.create_subprocess_exec(
        _script("haru-supervisor"),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(30):
            while True:
                raw = await process.stderr.readline()
                if not raw:
                    raise AssertionError("supervisor exited:\n" + "".join(lines))
                lines.append(raw.decode(errors="replace"))
                match = _LISTENING.search(lines[-1])
                if match:
                    break
        drain = asyncio.create_task(process.stderr.read())
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    await drain


@needs_proc
async def test_the_supervisor_reads_memory_and_processes_through_it(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    documents = tmp_path / "gpus.json"
    documents.write_text(
        dump_gpus([EmulatedGpu(index=0, checkpoint_dir=str(checkpoint)), EmulatedGpu(index=1)])
    )
    # As the package README says: the console script linked as nvidia-smi, first on PATH.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(_script("haru-sim-nvidia-smi"))
    config = {
        "slots": [
            {
                "kind": "training",
                "gpuIndex": 0,
                "command": [sys.executable, "-c", "pass"],
                "checkpointDir": str(checkpoint),
            }
        ]
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        PORT="0",
        HARU_SUPERVISOR_CONFIG=json.dumps(config),
        HARU_SUPERVISOR_GPU_SOURCE="nvidia-smi",
        HARU_SIM_GPUS=str(documents),
    )
    # A trainer as the supervisor starts one (it carries its slot's checkpoint directory);
    # it runs until its stdin closes.
    trainer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; sys.stdin.read()",
        stdin=asyncio.subprocess.PIPE,
        env={"HARU_CHECKPOINT_DIR": str(checkpoint)},
    )
    assert trainer.stdin is not None
    try:
        async with _supervisor(env) as base, aiohttp.ClientSession() as session:
            async with session.get(f"{base}/v1/gpu/processes") as answer:
                assert answer.status == 200, await answer.text()
                assert answer.headers["X-Haru-Gpu-Memory-Source"] == "nvidia-smi"
                processes = await answer.json()
            async with session.get(f"{base}/v1/gpu/memory") as answer:
                assert answer.status == 200, await answer.text()
                memory = await answer.json()
    finally:
        trainer.stdin.close()
        await trainer.wait()
    first, second = processes["gpus"]
    assert (first["index"], second["index"]) == (0, 1)
    assert {"pid": trainer.pid, "usedMiB": TRAINER_MIB} == {
        key: value for key, value in first["processes"][0].items() if key != "name"
    }
    assert [p["pid"] for p in first["processes"]] == [trainer.pid]
    assert second["processes"] == []
    assert [(g["usedMiB"], g["totalMiB"]) for g in memory["gpus"]] == [
        (CONTEXT_MIB + TRAINER_MIB, GPU_TOTAL_MIB),
        (CONTEXT_MIB, GPU_TOTAL_MIB),
    ]
