"""The demo's emulated ``nvidia-smi``: real emulated vLLM servers, real trainer processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from haru_demo._options import GPU_SCRIPT
from haru_sim import VllmSim, VllmSimConfig
from haru_sim.nvidia_smi import (
    CONTEXT_MIB,
    GPU_TOTAL_MIB,
    TRAINER_MIB,
    EmulatedGpu,
    GpuModel,
    dump_gpus,
    load_gpus,
    main,
    render,
    trainer_processes,
)
from haru_supervisor.api import NVIDIA_SMI_ARGS, parse_nvidia_smi_memory

QUERY = ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]
needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="trainers are found in /proc")


def test_the_supervisor_asks_exactly_the_query_it_answers() -> None:
    assert list(NVIDIA_SMI_ARGS) == QUERY


def test_gpu_document_round_trips_and_rejects_garbage() -> None:
    gpus = (
        EmulatedGpu(index=0, models=(GpuModel(name="m", port=8011, awake_mib=30_000),)),
        EmulatedGpu(index=1, checkpoint_dir="/ckpt/gpu1", total_mib=40_960),
    )
    assert load_gpus(dump_gpus(gpus)) == gpus
    for bad in (
        "{}",
        '{"gpus": []}',
        '{"gpus": [{"index": -1}]}',
        '{"gpus": [{"index": true}]}',
        '{"gpus": [{"index": 0, "models": [{"name": "m", "port": 0, "awake_mib": 1}]}]}',
        '{"gpus": [{"index": 0, "models": [{"name": "m"}]}]}',
        '{"gpus": "nope"}',
        "not json",
    ):
        with pytest.raises(ValueError, match=r"."):
            load_gpus(bad)


async def test_memory_follows_the_sleep_state_of_real_servers() -> None:
    async with (
        VllmSim(VllmSimConfig(served_model_names=("a",))) as awake,
        VllmSim(VllmSimConfig(served_model_names=("b",), start_asleep=True)) as asleep,
    ):
        dead = VllmSim(VllmSimConfig(served_model_names=("c",)))
        await dead.start()
        dead_port = dead.port
        await dead.stop()
        gpu = EmulatedGpu(
            index=0,
            models=(
                GpuModel(name="a", port=awake.port, awake_mib=30_000),
                GpuModel(name="b", port=asleep.port, awake_mib=30_000),
                GpuModel(name="c", port=dead_port, awake_mib=30_000),
            ),
        )
        # urllib blocks: keep the event loop (which serves the emulated vLLM) free.
        csv = await asyncio.to_thread(render, [gpu])
        assert csv == f"0, {CONTEXT_MIB + 30_000 + CONTEXT_MIB}, {GPU_TOTAL_MIB}\n"
        await awake.sleep()
        csv = await asyncio.to_thread(render, [gpu])
        assert csv == f"0, {3 * CONTEXT_MIB}, {GPU_TOTAL_MIB}\n"
        # What the supervisor's own parser makes of it.
        (memory,) = parse_nvidia_smi_memory(csv)
        assert (memory.index, memory.used_mib, memory.total_mib) == (0, 3 * CONTEXT_MIB, 81_920)


@needs_proc
async def test_a_live_trainer_holds_its_gpu_memory(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt-gpu1"
    gpu = EmulatedGpu(index=1, checkpoint_dir=str(directory))
    assert render([gpu]) == f"1, {CONTEXT_MIB}, {GPU_TOTAL_MIB}\n"
    trainer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_sim.trainer",
        "--step-ms",
        "20",
        env={**os.environ, "HARU_CHECKPOINT_DIR": str(directory)},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(200):
            if trainer.pid in trainer_processes():
                break
            await asyncio.sleep(0.02)
        assert trainer_processes()[trainer.pid] == str(directory)
        assert render([gpu]) == f"1, {CONTEXT_MIB + TRAINER_MIB}, {GPU_TOTAL_MIB}\n"
    finally:
        trainer.kill()
        await trainer.wait()
    assert render([gpu]) == f"1, {CONTEXT_MIB}, {GPU_TOTAL_MIB}\n"


def test_main_answers_the_query_and_rejects_anything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "gpus.json"
    document.write_text(dump_gpus([EmulatedGpu(index=0), EmulatedGpu(index=1)]))
    assert main([str(document), *QUERY]) == 0
    assert capsys.readouterr().out == f"0, {CONTEXT_MIB}, 81920\n1, {CONTEXT_MIB}, 81920\n"
    assert main([]) == 2
    assert main([str(document)]) == 2
    assert main([str(document), "-L"]) == 2
    assert "only" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), *QUERY]) == 9
    document.write_text("{}")
    assert main([str(document), *QUERY]) == 9


def test_it_runs_as_the_script_the_supervisor_executes(tmp_path: Path) -> None:
    document = tmp_path / "gpus.json"
    document.write_text(dump_gpus([EmulatedGpu(index=3)]))
    done = subprocess.run(
        # Exactly how the demo's nvidia-smi wrapper runs it: isolated, without site-packages.
        [sys.executable, "-I", "-S", str(GPU_SCRIPT), str(document), *QUERY],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (memory,) = parse_nvidia_smi_memory(done.stdout)
    assert memory.index == 3
