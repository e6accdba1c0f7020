"""An emulated ``nvidia-smi`` for running ``haru-supervisor`` without a GPU.

Two ways to run it: the ``haru-sim-nvidia-smi`` console script (linked or wrapped as
``nvidia-smi`` first on the supervisor's ``PATH``; the GPU document from ``HARU_SIM_GPUS``), or
this file as a script, ``python -I -S nvidia_smi.py GPU_JSON <nvidia-smi arguments>``
(standard library only, so it starts in milliseconds: what ``haru demo`` and
``deploy/sim.Dockerfile`` do). The supervisor then reads GPU memory through its real
``nvidia-smi`` path, and the numbers follow what really runs on that emulated GPU, so
``verify_gpu`` proves something:

- every GPU holds a small CUDA context;
- every awake emulated vLLM server on it holds its share of the GPU (asleep at level 1, weights
  sit in CPU RAM and only its context stays; a server that does not answer holds nothing);
- a live trainer whose ``HARU_CHECKPOINT_DIR`` is the GPU's training checkpoint directory
  holds its training memory (found through ``/proc``; on systems without it, trainers are not
  seen).

The queries the supervisor makes are answered, all with ``--format=csv,noheader,nounits``:
``--query-gpu=index,memory.used,memory.total`` (memory), ``--query-gpu=index,uuid`` and
``--query-compute-apps=pid,gpu_uuid,used_memory`` (the trainers as compute processes; emulated
vLLM servers have no pid to report); anything else exits 2, as a real tool rejects bad flags.
Without a GPU document there is one 80 GiB GPU, index 0, with nothing on it but trainers.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

# Only the standard library: this runs as a fresh process on every GPU memory query.

GPU_TOTAL_MIB: Final = 81_920
"""An 80 GiB accelerator."""
CONTEXT_MIB: Final = 512
"""CUDA context of the GPU (and of each vLLM server, asleep or awake)."""
TRAINER_MIB: Final = 40_960
"""What a LoRA trainer takes in the VRAM that sleep freed."""

_QUERY: Final = "--query-gpu=index,memory.used,memory.total"
_UUID_QUERY: Final = "--query-gpu=index,uuid"
_APPS_QUERY: Final = "--query-compute-apps=pid,gpu_uuid,used_memory"
_FORMAT: Final = "--format=csv,noheader,nounits"
GPUS_VAR: Final = "HARU_SIM_GPUS"
"""Path of the GPU document (:func:`dump_gpus`) for the console script."""
_IS_SLEEPING_TIMEOUT_S: Final = 0.5


@dataclass(frozen=True, slots=True)
class GpuModel:
    """An emulated vLLM server on the GPU and the memory it holds while awake."""

    name: str
    port: int
    awake_mib: int


@dataclass(frozen=True, slots=True)
class EmulatedGpu:
    """One emulated GPU of a domain.

    Attributes:
        index: GPU index.
        models: The emulated vLLM servers on it.
        checkpoint_dir: Checkpoint directory of its training slot (its trainer holds memory).
        total_mib: Memory of the GPU.
    """

    index: int
    models: tuple[GpuModel, ...] = ()
    checkpoint_dir: str | None = None
    total_mib: int = GPU_TOTAL_MIB


def dump_gpus(gpus: Sequence[EmulatedGpu]) -> str:
    """The GPU document the wrapper script points at."""
    return json.dumps({"gpus": [asdict(g) for g in gpus]}, indent=2)


def write_nvidia_smi(bin_dir: Path, gpus: Sequence[EmulatedGpu]) -> Path:
    """Write the emulated ``nvidia-smi`` for ``gpus`` into ``bin_dir`` (put it first on a PATH).

    The wrapper runs this module as a script in isolated mode without site-packages: it needs
    only the standard library, and importing the haru_sim package (aiohttp) would cost a second per
    GPU query. The GPU document sits next to it as ``gpus.json``.

    Returns:
        The wrapper's path.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    gpu_path = bin_dir / "gpus.json"
    gpu_path.write_text(dump_gpus(gpus), encoding="utf-8")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f"exec {shlex.quote(sys.executable)} -I -S {shlex.quote(str(Path(__file__)))} "
        f'{shlex.quote(str(gpu_path))} "$@"\n',
        encoding="utf-8",
    )
    smi.chmod(0o755)
    return smi


def _int(value: Any, what: str, *, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _gpu(raw: Mapping[str, Any]) -> EmulatedGpu:
    models = tuple(
        GpuModel(
            name=str(m["name"]),
            port=_int(m["port"], "port", low=1),
            awake_mib=_int(m["awake_mib"], "awake_mib"),
        )
        for m in raw.get("models", ())
    )
    directory = raw.get("checkpoint_dir")
    return EmulatedGpu(
        index=_int(raw["index"], "index"),
        models=models,
        checkpoint_dir=None if directory is None else str(directory),
        total_mib=_int(raw.get("total_mib", GPU_TOTAL_MIB), "total_mib", low=1),
    )


def load_gpus(text: str) -> tuple[EmulatedGpu, ...]:
    """Parse the GPU document.

    Raises:
        ValueError: It is not the document :func:`dump_gpus` writes.
    """
    try:
        document = json.loads(text)
        gpus = tuple(_gpu(g) for g in document["gpus"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed GPU document: {exc!r}") from exc
    if not gpus:
        raise ValueError("the GPU document lists no GPU")
    return gpus


def _proc_environ(pid: str) -> dict[str, str]:
    try:
        raw = Path("/proc", pid, "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, _, v in pairs}


def trainer_processes() -> dict[int, str]:
    """Live processes that carry ``HARU_CHECKPOINT_DIR``, with its value, by pid.

    Reads ``/proc/<pid>/environ`` (Linux); elsewhere it finds nothing.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    found: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        directory = _proc_environ(entry.name).get("HARU_CHECKPOINT_DIR")
        if directory:
            found[int(entry.name)] = directory
    return found


def _is_awake(port: int) -> bool | None:
    """True/False from ``/is_sleeping``; None when the server does not answer."""
    url = f"http://127.0.0.1:{port}/is_sleeping"
    try:
        with urllib.request.urlopen(
            url, timeout=_IS_SLEEPING_TIMEOUT_S
        ) as response:  # a fixed http URL on loopback
            body = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    sleeping = body.get("is_sleeping") if isinstance(body, dict) else None
    # Anything but a boolean proves nothing: count the memory as held, as a GPU would.
    return True if not isinstance(sleeping, bool) else not sleeping


def used_mib(gpu: EmulatedGpu, trainer_dirs: set[str]) -> int:
    """Memory in use on ``gpu`` now."""
    used = CONTEXT_MIB
    for model in gpu.models:
        awake = _is_awake(model.port)
        if awake is None:
            continue  # a dead server frees its memory
        used += model.awake_mib if awake else CONTEXT_MIB
    if gpu.checkpoint_dir is not None and gpu.checkpoint_dir in trainer_dirs:
        used += TRAINER_MIB
    return min(used, gpu.total_mib)


def render(gpus: Sequence[EmulatedGpu]) -> str:
    """The CSV ``nvidia-smi`` prints for the memory query."""
    trainer_dirs = set(trainer_processes().values())
    lines = [f"{g.index}, {used_mib(g, trainer_dirs)}, {g.total_mib}" for g in gpus]
    return "\n".join(lines) + "\n"


def gpu_uuid(gpu: EmulatedGpu) -> str:
    """A stable uuid for ``gpu``, shaped like the driver's."""
    return f"GPU-00000000-0000-4000-8000-{gpu.index:012d}"


def render_uuids(gpus: Sequence[EmulatedGpu]) -> str:
    """The CSV of ``--query-gpu=index,uuid``."""
    return "".join(f"{g.index}, {gpu_uuid(g)}\n" for g in gpus)


def render_apps(gpus: Sequence[EmulatedGpu]) -> str:
    """The CSV of ``--query-compute-apps``: each live trainer on its GPU (empty: none)."""
    by_dir = {g.checkpoint_dir: g for g in gpus if g.checkpoint_dir is not None}
    lines = [
        f"{pid}, {gpu_uuid(by_dir[directory])}, {TRAINER_MIB}"
        for pid, directory in sorted(trainer_processes().items())
        if directory in by_dir
    ]
    return "".join(line + "\n" for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``haru-sim-nvidia-smi ARGS...`` or ``python nvidia_smi.py GPU_JSON ARGS...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    path: Path | None = None
    if args and not args[0].startswith("-"):
        path, args = Path(args[0]), args[1:]
    elif os.environ.get(GPUS_VAR):
        path = Path(os.environ[GPUS_VAR])
    queries = {_QUERY: render, _UUID_QUERY: render_uuids, _APPS_QUERY: render_apps}
    asked = [flag for flag in args if flag in queries]
    if len(asked) != 1 or _FORMAT not in args or len(args) != 2:
        supported = ", ".join(f"'{query} {_FORMAT}'" for query in queries)
        sys.stderr.write(f"emulated nvidia-smi: only {supported} are supported, got {args!r}\n")
        return 2
    try:
        gpus = (
            (EmulatedGpu(index=0),) if path is None else load_gpus(path.read_text(encoding="utf-8"))
        )
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"emulated nvidia-smi: cannot read {path}: {exc}\n")
        return 9
    sys.stdout.write(queries[asked[0]](gpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
