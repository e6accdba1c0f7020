"""GPU check of the supervisor's training preemption and GPU memory report (needs a GPU host).

Run from the workspace root on a host with an NVIDIA GPU and a Python that has torch::

    uv run python services/supervisor/scripts/gpu_check.py
    uv run python services/supervisor/scripts/gpu_check.py --trainer-python /opt/conda/bin/python

For each GPU memory source (``nvml`` and ``nvidia-smi``, forced through
``HARU_SUPERVISOR_GPU_SOURCE``) it starts ``haru-supervisor`` with one training slot whose
command holds ``--gib`` GiB of VRAM (``torch.empty(..., device="cuda")``) until SIGTERM, reads
``GET /v1/gpu/memory`` before, while held and after ``POST /v1/training/stop``, and measures how
long the release takes. A last scenario uses a trainer that ignores SIGTERM, so the memory comes
back only when the supervisor SIGKILLs the group at the grace. It prints one JSON report on
stdout and exits 0 when every available source saw the memory held and released, 1 otherwise,
2 when the host cannot run the check (no torch, no CUDA).

The NVML source needs nvidia-ml-py in the workspace environment (the ``nvml`` extra of
haru-supervisor); without it the report says the source is unavailable (HTTP 501), which is
itself the expected behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HOLDER = r"""
import os, select, signal, sys
from pathlib import Path

import torch

gpu = int(os.environ["HARU_GPU_INDEX"])
gib = float(sys.argv[1])
ignore_term = sys.argv[2] == "ignore"
# The handler takes no lock (an Event.set() there can deadlock): it writes to a pipe the
# final wait selects on.
wake_read, wake_write = os.pipe()
signal.signal(
    signal.SIGTERM, signal.SIG_IGN if ignore_term else (lambda *_: os.write(wake_write, b"x"))
)
# The trainer contract: pin yourself to HARU_GPU_INDEX.
torch.cuda.set_device(gpu)
held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=f"cuda:{gpu}")
held.fill_(1)
torch.cuda.synchronize()
checkpoint_dir = Path(os.environ["HARU_CHECKPOINT_DIR"])
checkpoint_dir.mkdir(parents=True, exist_ok=True)
(checkpoint_dir / "ready").write_text(str(os.getpid()))
select.select([wake_read], [], [])
"""

_LISTENING = re.compile(r"listening on http://([0-9.]+):([0-9]+)")
_POLL_S = 0.02


def _log(message: str) -> None:
    sys.stderr.write(f"gpu_check: {message}\n")
    sys.stderr.flush()


class Supervisor:
    """``python -m haru_supervisor`` as a child process, with its log collected."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.port = 0
        self.lines: list[str] = []
        self.listening = asyncio.Event()
        if process.stderr is None:
            raise RuntimeError("the supervisor's stderr is not piped")
        self.reader = asyncio.create_task(self._collect(process.stderr))

    async def _collect(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match:
                self.port = int(match.group(2))
                self.listening.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> int | None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 60)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        await self.reader
        return self.process.returncode


async def _start_supervisor(env: dict[str, str]) -> Supervisor:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_supervisor",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    supervisor = Supervisor(process)
    try:
        await asyncio.wait_for(supervisor.listening.wait(), 30)
    except TimeoutError:
        await supervisor.stop()
        raise RuntimeError(
            "the supervisor did not start:\n" + "\n".join(supervisor.lines)
        ) from None
    return supervisor


async def _memory(http: aiohttp.ClientSession, gpu: int) -> tuple[int, str, float | None, Any]:
    """(status, source header, used MiB of ``gpu``, body)."""
    async with http.get("/v1/gpu/memory") as response:
        body = await response.json()
        source = response.headers.get("X-Haru-Gpu-Memory-Source", "")
        used = None
        if response.status == 200:
            used = next((g["usedMiB"] for g in body["gpus"] if g["index"] == gpu), None)
        return response.status, source, used, body


async def _training_state(http: aiohttp.ClientSession) -> tuple[str, list[int]]:
    async with http.get("/v1/training/status") as response:
        slot = (await response.json())["slots"][0]
        return slot["state"], slot["pids"]


async def _scenario(
    *,
    name: str,
    source: str,
    args: argparse.Namespace,
    workdir: Path,
    holder: Path,
    ignore_term: bool,
) -> dict[str, Any]:
    checkpoint_dir = workdir / name
    config = {
        "slots": [
            {
                "kind": "training",
                "gpuIndex": args.gpu,
                "command": [
                    args.trainer_python,
                    str(holder),
                    str(args.gib),
                    "ignore" if ignore_term else "term",
                ],
                "checkpointDir": str(checkpoint_dir),
            }
        ]
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env |= {
        "PORT": "0",
        "HARU_SUPERVISOR_CONFIG": json.dumps(config),
        "HARU_SUPERVISOR_GPU_SOURCE": source,
        # HARU_GPU_INDEX follows nvidia-smi's numbering; make CUDA's agree.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTHONUNBUFFERED": "1",
    }
    report: dict[str, Any] = {"scenario": name, "source": source, "ok": False}
    supervisor = await _start_supervisor(env)
    try:
        async with aiohttp.ClientSession(supervisor.url) as http:
            status, header, baseline, body = await _memory(http, args.gpu)
            report["sourceHeader"] = header
            if status != 200:
                report |= {"available": False, "status": status, "error": body.get("error")}
                report["ok"] = status == 501
                return report
            report |= {
                "available": True,
                "baselineUsedMiB": baseline,
                "totalMiB": _total(body, args.gpu),
            }
            if baseline is None:
                report["error"] = f"GPU {args.gpu} is not in the report: {body}"
                return report
            held_target = baseline + args.gib * 1024 * 0.95

            started = time.monotonic()
            async with http.post("/v1/training/start") as response:
                report["startStatus"] = response.status
            held = baseline
            while time.monotonic() - started < args.timeout_s:
                _, _, used, _ = await _memory(http, args.gpu)
                if used is not None:
                    held = used
                if held >= held_target and (checkpoint_dir / "ready").exists():
                    break
                await asyncio.sleep(0.1)
            report["heldUsedMiB"] = held
            report["holdSeconds"] = round(time.monotonic() - started, 3)
            state, pids = await _training_state(http)
            report["trainingWhileHeld"] = {"state": state, "pids": pids}
            if held < held_target:
                report["error"] = f"the trainer never held {args.gib} GiB (saw {held} MiB)"
                return report

            grace_ms = args.kill_grace_ms if ignore_term else args.grace_ms
            stop_at = time.monotonic()
            async with http.post("/v1/training/stop", json={"graceMs": grace_ms}) as response:
                report["stopStatus"] = response.status
            released_s: float | None = None
            idle_s: float | None = None
            after = held
            # (seconds since the stop request when the reading came back, used MiB); a
            # release time is therefore an upper bound by one reading's latency.
            samples: list[tuple[float, float]] = []
            while time.monotonic() - stop_at < grace_ms / 1000 + args.timeout_s:
                _, _, used, _ = await _memory(http, args.gpu)
                elapsed = time.monotonic() - stop_at
                if used is not None:
                    after = used
                    samples.append((round(elapsed, 3), used))
                    if released_s is None and used <= baseline + args.release_slack_mib:
                        released_s = round(elapsed, 3)
                if idle_s is None:
                    state, _ = await _training_state(http)
                    if state == "idle":
                        idle_s = round(time.monotonic() - stop_at, 3)
                if released_s is not None and idle_s is not None:
                    break
                await asyncio.sleep(_POLL_S)
            report |= {
                "graceMs": grace_ms,
                "afterUsedMiB": after,
                "releaseSeconds": released_s,
                "idleSeconds": idle_s,
                "samplesAfterStop": samples[:: max(1, len(samples) // 40)],
            }
            report["ok"] = released_s is not None and idle_s is not None
            if ignore_term:
                # Memory must come back only at the SIGKILL, not at the ignored SIGTERM: every
                # reading well inside the grace still shows it held.
                inside = [used for at, used in samples if at < grace_ms / 1000 * 0.8]
                report["heldDuringGrace"] = bool(inside) and all(
                    used > baseline + args.release_slack_mib for used in inside
                )
                report["ok"] = report["ok"] and report["heldDuringGrace"]
            return report
    finally:
        report["supervisorExit"] = await supervisor.stop()
        report["supervisorLogTail"] = supervisor.lines[-15:]


def _total(body: dict[str, Any], gpu: int) -> float | None:
    return next((g["totalMiB"] for g in body["gpus"] if g["index"] == gpu), None)


async def _preflight(python: str, gpu: int) -> str | None:
    process = await asyncio.create_subprocess_exec(
        python,
        "-c",
        "import sys, torch; sys.stdout.write(f'{torch.__version__} {torch.cuda.device_count()}')",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    if process.returncode != 0:
        return f"{python} cannot import torch: {stderr.decode(errors='replace')[-400:]}"
    version, count = stdout.decode().split()
    if int(count) <= gpu:
        return f"torch {version} sees {count} CUDA device(s); GPU {gpu} is not among them"
    return None


async def main_async(args: argparse.Namespace) -> int:
    problem = await _preflight(args.trainer_python, args.gpu)
    if problem is not None:
        sys.stdout.write(json.dumps({"ok": False, "error": problem}, indent=1) + "\n")
        return 2
    scenarios: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="haru-gpu-check-") as tmp:
        workdir = Path(tmp)
        holder = workdir / "hold_vram.py"
        holder.write_text(HOLDER)
        for source in args.sources:
            _log(f"scenario sigterm with source {source}")
            scenarios.append(
                await _scenario(
                    name=f"sigterm-{source}",
                    source=source,
                    args=args,
                    workdir=workdir,
                    holder=holder,
                    ignore_term=False,
                )
            )
        _log("scenario sigkill (trainer ignores SIGTERM) with source auto")
        scenarios.append(
            await _scenario(
                name="sigkill-auto",
                source="auto",
                args=args,
                workdir=workdir,
                holder=holder,
                ignore_term=True,
            )
        )
    baselines = {
        s["sourceHeader"]: s["baselineUsedMiB"]
        for s in scenarios
        if s.get("available") and s["scenario"].startswith("sigterm-")
    }
    report: dict[str, Any] = {
        "gpu": args.gpu,
        "gib": args.gib,
        "scenarios": scenarios,
        "baselineUsedMiBBySource": baselines,
    }
    if len(baselines) > 1:
        # One definition of "used" (driver-reserved memory excluded) whatever the source.
        values = list(baselines.values())
        report["sourcesAgree"] = max(values) - min(values) <= args.agree_mib
    report["ok"] = all(s["ok"] for s in scenarios) and report.get("sourcesAgree", True)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0 if report["ok"] else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (nvidia-smi numbering)")
    parser.add_argument("--gib", type=float, default=20.0, help="VRAM the trainer holds")
    parser.add_argument(
        "--trainer-python", default=sys.executable, help="a Python with torch for the trainer"
    )
    parser.add_argument(
        "--sources",
        type=lambda text: [s for s in text.split(",") if s],
        default=["nvml", "nvidia-smi"],
        help="comma-separated GPU memory sources to check",
    )
    parser.add_argument("--grace-ms", type=int, default=10_000, help="stop grace (SIGTERM case)")
    parser.add_argument(
        "--kill-grace-ms", type=int, default=2_000, help="stop grace (SIGTERM ignored case)"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound of each wait")
    parser.add_argument(
        "--release-slack-mib", type=float, default=256.0, help="released = baseline + this"
    )
    parser.add_argument(
        "--agree-mib", type=float, default=64.0, help="max baseline gap between sources"
    )
    return parser


def main() -> int:
    args = _parser().parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main_async(args))
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
