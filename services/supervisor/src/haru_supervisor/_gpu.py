"""GPU memory (DESIGN 6.6): NVML when it is installed and finds a GPU, else ``nvidia-smi``.

One definition of "used" whatever the source: memory allocated by processes and their CUDA
contexts, EXCLUDING the memory the driver reserves for itself. That is what ``nvidia-smi``
reports as ``memory.used`` (an idle H200 shows 0 MiB used, 616 MiB reserved) and what NVML's
``nvmlDeviceGetMemoryInfo_v2`` reports as ``used``. NVML's v1 call counts the reserved memory
as used (about 615 MiB on that idle H200); it is only used on a driver without the v2 call,
with a warning at start-up, and the response header ``X-Haru-Gpu-Memory-Source`` then says
``nvml-v1``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Protocol

from haru_exec import Exec, ExecError, ExecResult, format_exec_failure, run_exec
from haru_protocol import GpuMemory, GpuProcess

from haru_supervisor._errors import GpuMemorySourceError, GpuMemoryUnavailable
from haru_supervisor._settings import GpuSource

logger = logging.getLogger(__name__)

NVIDIA_SMI: Final = "nvidia-smi"
NVIDIA_SMI_ARGS: Final = (
    "--query-gpu=index,memory.used,memory.total",
    "--format=csv,noheader,nounits",
)
NVIDIA_SMI_UUID_ARGS: Final = ("--query-gpu=index,uuid", "--format=csv,noheader,nounits")
NVIDIA_SMI_APPS_ARGS: Final = (
    "--query-compute-apps=pid,gpu_uuid,used_memory",
    "--format=csv,noheader,nounits",
)
"""The compute processes; GPUs are named by uuid there, hence the index/uuid query."""
NVIDIA_SMI_TIMEOUT_S: Final = 5.0
"""One exec takes about 25 ms on an H200 host; a hung driver must not hang the API."""

NVML_TIMEOUT_S: Final = 5.0
"""An NVML call takes about 0.01 ms; a GPU fallen off the bus can block one for seconds."""

SOURCE_HEADER: Final = "X-Haru-Gpu-Memory-Source"
"""Response header naming the source: ``nvml-v2``, ``nvml-v1`` or ``nvidia-smi``."""

_MIB: Final = 1024 * 1024
_LINE_QUOTE: Final = 120
_INDEX_RE: Final = re.compile(r"^[0-9]+$")
_NUMBER_RE: Final = re.compile(r"^[0-9]+(\.[0-9]+)?$")


def _quote_line(line: str) -> str:
    text = line if len(line) <= _LINE_QUOTE else line[:_LINE_QUOTE] + "..."
    return repr(text)


def parse_nvidia_smi_memory(text: str) -> tuple[GpuMemory, ...]:
    """Parse ``nvidia-smi --query-gpu=index,memory.used,memory.total`` CSV (no header, no units).

    Every non-blank line must hold exactly three numeric columns: an integer index, then used
    and total MiB. MIG mode and some drivers print ``[N/A]``; a header or units mean the
    output drifted; either is an error, never a guess.

    Raises:
        GpuMemorySourceError: A line is malformed, an index repeats, or there is no line.
    """
    gpus: list[GpuMemory] = []
    seen: set[int] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        columns = [column.strip() for column in line.split(",")]
        if len(columns) != 3:
            raise GpuMemorySourceError(
                f"nvidia-smi line {number} has {len(columns)} columns, expected 3 "
                f"(index, memory.used, memory.total): {_quote_line(line)}"
            )
        index, used, total = columns
        if not _INDEX_RE.match(index) or not _NUMBER_RE.match(used) or not _NUMBER_RE.match(total):
            raise GpuMemorySourceError(
                f"nvidia-smi line {number} is not numeric (MIG mode reports [N/A]): "
                f"{_quote_line(line)}"
            )
        gpu_index = int(index)
        if gpu_index in seen:
            raise GpuMemorySourceError(f"nvidia-smi reported GPU {gpu_index} twice")
        seen.add(gpu_index)
        gpus.append(GpuMemory(index=gpu_index, used_mib=float(used), total_mib=float(total)))
    if not gpus:
        raise GpuMemorySourceError("nvidia-smi reported no GPU")
    return tuple(gpus)


def parse_nvidia_smi_uuids(text: str) -> dict[str, int]:
    """Parse ``nvidia-smi --query-gpu=index,uuid`` CSV (no header): uuid to index.

    Raises:
        GpuMemorySourceError: A line is not ``index, uuid`` or there is no line.
    """
    uuids: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        columns = [column.strip() for column in line.split(",")]
        if len(columns) != 2 or not _INDEX_RE.match(columns[0]) or not columns[1]:
            raise GpuMemorySourceError(
                f"nvidia-smi uuid line {number} is not 'index, uuid': {_quote_line(line)}"
            )
        uuids[columns[1]] = int(columns[0])
    if not uuids:
        raise GpuMemorySourceError("nvidia-smi reported no GPU uuid")
    return uuids


def parse_nvidia_smi_apps(text: str, uuids: Mapping[str, int]) -> dict[int, tuple[GpuProcess, ...]]:
    """Parse ``--query-compute-apps=pid,gpu_uuid,used_memory`` CSV: processes per GPU index.

    Empty output (exit 0) means no process holds any GPU. ``used_memory`` may be ``[N/A]``
    (some containers): the process is kept, its memory unknown.

    Raises:
        GpuMemorySourceError: A line is malformed or names a GPU missing from ``uuids``.
    """
    found: dict[int, list[GpuProcess]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        columns = [column.strip() for column in line.split(",")]
        if len(columns) != 3 or not _INDEX_RE.match(columns[0]):
            raise GpuMemorySourceError(
                f"nvidia-smi process line {number} is not 'pid, gpu_uuid, used_memory': "
                f"{_quote_line(line)}"
            )
        pid_text, uuid, used = columns
        if uuid not in uuids:
            raise GpuMemorySourceError(
                f"nvidia-smi process line {number} names an unknown GPU {uuid[:80]!r}"
            )
        pid = int(pid_text)
        used_mib = float(used) if _NUMBER_RE.match(used) else None
        found.setdefault(uuids[uuid], []).append(
            GpuProcess(pid=pid, name=process_name(pid), used_mib=used_mib)
        )
    return {index: tuple(processes) for index, processes in found.items()}


def process_name(pid: int) -> str | None:
    """The command name of ``pid`` (``/proc/<pid>/comm``), when this host shows it."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return name[:_LINE_QUOTE] or None


class GpuMemorySource(Protocol):
    """A way to read every GPU's memory."""

    @property
    def name(self) -> str:
        """``nvml-v2``, ``nvml-v1`` or ``nvidia-smi``."""

    async def read(self) -> tuple[GpuMemory, ...]:
        """Every GPU's memory.

        Raises:
            GpuMemorySourceError: The source failed or printed nonsense.
        """

    async def processes(self) -> dict[int, tuple[GpuProcess, ...]]:
        """The compute processes holding memory, per GPU index (GPUs without any absent).

        Raises:
            GpuMemorySourceError: The source cannot list them.
        """

    def close(self) -> None:
        """Release the source."""


class NvidiaSmiSource:
    """``nvidia-smi`` run through the exec boundary (argv, no shell, bounded time)."""

    def __init__(
        self,
        executable: str,
        *,
        exec_: Exec = run_exec,
        timeout_s: float = NVIDIA_SMI_TIMEOUT_S,
    ) -> None:
        """Use ``executable`` (a resolved path to ``nvidia-smi``)."""
        self._argv = (executable, *NVIDIA_SMI_ARGS)
        self._executable = executable
        self._exec = exec_
        self._timeout_s = timeout_s
        self._uuids: dict[str, int] | None = None

    @property
    def name(self) -> str:
        return "nvidia-smi"

    @property
    def argv(self) -> tuple[str, ...]:
        """The exact command run on each read."""
        return self._argv

    async def _run(self, argv: tuple[str, ...]) -> ExecResult:
        try:
            result = await self._exec(argv, timeout=self._timeout_s)
        except ExecError as exc:
            raise GpuMemorySourceError(str(exc)) from exc
        if not result.ok:
            raise GpuMemorySourceError(format_exec_failure(result, limit=400))
        return result

    async def read(self) -> tuple[GpuMemory, ...]:
        return parse_nvidia_smi_memory((await self._run(self._argv)).stdout)

    async def processes(self) -> dict[int, tuple[GpuProcess, ...]]:
        apps = await self._run((self._executable, *NVIDIA_SMI_APPS_ARGS))
        if not apps.stdout.strip():
            return {}
        # A GPU's uuid never changes while the host runs: asked once, again only when a
        # process names a GPU not seen yet.
        uuids = self._uuids
        if uuids is None or any(
            line.split(",")[1].strip() not in uuids
            for line in apps.stdout.splitlines()
            if line.count(",") == 2
        ):
            result = await self._run((self._executable, *NVIDIA_SMI_UUID_ARGS))
            uuids = self._uuids = parse_nvidia_smi_uuids(result.stdout)
        return await asyncio.to_thread(parse_nvidia_smi_apps, apps.stdout, uuids)

    def close(self) -> None:
        return None


class NvmlMemory(Protocol):
    """What ``nvmlDeviceGetMemoryInfo`` returns (bytes); v2 adds ``reserved``."""

    total: int
    used: int


class NvmlApi(Protocol):
    """The part of ``pynvml`` (nvidia-ml-py) the supervisor uses."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...  # noqa: N802  (NVML's names)

    def nvmlShutdown(self) -> None: ...  # noqa: N802

    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object: ...  # noqa: N802

    def nvmlDeviceGetMemoryInfo(  # noqa: N802
        self, handle: object, version: int | None = None
    ) -> NvmlMemory: ...


NvmlLoader = Callable[[], NvmlApi | None]
"""Returns the NVML bindings, or None when they are not installed."""


def load_pynvml() -> NvmlApi | None:
    """Import ``pynvml`` (the ``nvml`` extra) lazily; None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    api: NvmlApi = pynvml
    return api


class NvmlSource:
    """NVML through nvidia-ml-py, with ``nvmlDeviceGetMemoryInfo_v2`` when the driver has it."""

    def __init__(self, api: NvmlApi, *, count: int, version: int | None) -> None:
        """Use an initialised NVML; prefer :meth:`open`."""
        self._api = api
        self._count = count
        self._version = version
        self._closed = False

    @classmethod
    def open(cls, api: NvmlApi) -> NvmlSource:
        """Initialise NVML and choose the memory call (blocking: run it off the event loop).

        Raises:
            GpuMemoryUnavailable: NVML cannot initialise (no driver) or sees no GPU.
        """
        try:
            api.nvmlInit()
        except api.NVMLError as exc:
            raise GpuMemoryUnavailable(f"NVML cannot initialise: {exc}") from exc
        try:
            count = api.nvmlDeviceGetCount()
            version = cls._choose_version(api, api.nvmlDeviceGetHandleByIndex(0)) if count else None
        except api.NVMLError as exc:
            api.nvmlShutdown()
            raise GpuMemoryUnavailable(f"NVML cannot query the GPUs: {exc}") from exc
        if count < 1:
            api.nvmlShutdown()
            raise GpuMemoryUnavailable("NVML sees no GPU")
        return cls(api, count=count, version=version)

    @staticmethod
    def _choose_version(api: NvmlApi, handle: object) -> int | None:
        version = getattr(api, "nvmlMemory_v2", None)
        if isinstance(version, int):
            try:
                api.nvmlDeviceGetMemoryInfo(handle, version=version)
            except (api.NVMLError, TypeError) as exc:
                # Old drivers lack the v2 call; some nvidia-ml-py releases set the struct's
                # version field wrongly and get a version mismatch.
                logger.warning("NVML memory info v2 unavailable (%s)", exc)
            else:
                return version
        logger.warning(
            "using NVML memory info v1: usedMiB INCLUDES driver-reserved memory (about 600 MiB "
            "per GPU), unlike nvidia-smi; set HARU_SUPERVISOR_GPU_SOURCE=nvidia-smi to exclude it"
        )
        return None

    @property
    def name(self) -> str:
        return "nvml-v1" if self._version is None else "nvml-v2"

    @property
    def count(self) -> int:
        """How many GPUs NVML sees."""
        return self._count

    def _read_sync(self) -> tuple[GpuMemory, ...]:
        gpus: list[GpuMemory] = []
        for index in range(self._count):
            handle = self._api.nvmlDeviceGetHandleByIndex(index)
            if self._version is None:
                info = self._api.nvmlDeviceGetMemoryInfo(handle)
            else:
                info = self._api.nvmlDeviceGetMemoryInfo(handle, version=self._version)
            gpus.append(
                GpuMemory(
                    index=index,
                    used_mib=round(info.used / _MIB, 2),
                    total_mib=round(info.total / _MIB, 2),
                )
            )
        return tuple(gpus)

    def _processes_sync(self) -> dict[int, tuple[GpuProcess, ...]]:
        listing = getattr(self._api, "nvmlDeviceGetComputeRunningProcesses", None)
        if listing is None:
            raise GpuMemorySourceError("this NVML cannot list the compute processes")
        found: dict[int, tuple[GpuProcess, ...]] = {}
        for index in range(self._count):
            running = listing(self._api.nvmlDeviceGetHandleByIndex(index))
            processes = tuple(
                GpuProcess(
                    pid=int(process.pid),
                    name=process_name(int(process.pid)),
                    used_mib=(
                        None
                        if getattr(process, "usedGpuMemory", None) is None
                        else round(process.usedGpuMemory / _MIB, 2)
                    ),
                )
                for process in running
            )
            if processes:
                found[index] = processes
        return found

    async def processes(self) -> dict[int, tuple[GpuProcess, ...]]:
        try:
            async with asyncio.timeout(NVML_TIMEOUT_S):
                return await asyncio.to_thread(self._processes_sync)
        except TimeoutError as exc:
            raise GpuMemorySourceError(f"NVML did not answer within {NVML_TIMEOUT_S:g} s") from exc
        except self._api.NVMLError as exc:
            raise GpuMemorySourceError(f"NVML failed: {exc}") from exc

    async def read(self) -> tuple[GpuMemory, ...]:
        try:
            async with asyncio.timeout(NVML_TIMEOUT_S):
                return await asyncio.to_thread(self._read_sync)
        except TimeoutError as exc:
            raise GpuMemorySourceError(f"NVML did not answer within {NVML_TIMEOUT_S:g} s") from exc
        except self._api.NVMLError as exc:
            raise GpuMemorySourceError(f"NVML failed: {exc}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._api.nvmlShutdown()
            except self._api.NVMLError as exc:
                logger.warning("NVML shutdown failed: %s", exc)


class GpuMemoryReader:
    """The source chosen at start-up, or why there is none."""

    def __init__(self, source: GpuMemorySource | None, *, unavailable: str = "") -> None:
        """Wrap ``source``; with None, every read raises :class:`GpuMemoryUnavailable`."""
        self._source = source
        self._unavailable = unavailable or "GPU introspection is not configured"

    @property
    def source(self) -> GpuMemorySource | None:
        """The source in use, if any."""
        return self._source

    async def read(self) -> tuple[GpuMemory, ...]:
        """Every GPU's memory.

        Raises:
            GpuMemoryUnavailable: No source is usable on this host.
            GpuMemorySourceError: The source failed.
        """
        if self._source is None:
            raise GpuMemoryUnavailable(self._unavailable)
        return await self._source.read()

    async def read_with_processes(self) -> tuple[GpuMemory, ...]:
        """Every GPU's memory and the compute processes holding it.

        Raises:
            GpuMemoryUnavailable: No source is usable on this host.
            GpuMemorySourceError: The source failed or cannot list processes.
        """
        if self._source is None:
            raise GpuMemoryUnavailable(self._unavailable)
        gpus, processes = await asyncio.gather(self._source.read(), self._source.processes())
        return tuple(
            gpu.model_copy(update={"processes": processes.get(gpu.index, ())}) for gpu in gpus
        )

    def close(self) -> None:
        """Release the source."""
        if self._source is not None:
            self._source.close()


async def open_gpu_reader(
    mode: GpuSource,
    *,
    exec_: Exec = run_exec,
    nvml_loader: NvmlLoader = load_pynvml,
    search_path: str | None = None,
) -> GpuMemoryReader:
    """Choose the GPU memory source for ``mode``.

    ``auto`` prefers NVML (installed and seeing a GPU), then ``nvidia-smi`` on the search path;
    ``nvml`` and ``nvidia-smi`` use only that source. Never raises: a missing source becomes a
    reader that answers 501.

    Args:
        mode: Which source(s) to consider.
        exec_: Runs ``nvidia-smi``.
        nvml_loader: Imports the NVML bindings.
        search_path: ``PATH`` to find ``nvidia-smi`` on (None: the process's ``PATH``).
    """
    reasons: list[str] = []
    if mode in ("auto", "nvml"):
        api = nvml_loader()
        if api is None:
            reasons.append("NVML bindings are not installed (the haru-supervisor[nvml] extra)")
        else:
            try:
                source = await asyncio.to_thread(NvmlSource.open, api)
            except GpuMemoryUnavailable as exc:
                reasons.append(str(exc))
            else:
                logger.info("GPU memory source: %s (%d GPU(s))", source.name, source.count)
                return GpuMemoryReader(source)
    if mode in ("auto", "nvidia-smi"):
        executable = shutil.which(NVIDIA_SMI, path=search_path)
        if executable is None:
            reasons.append(f"{NVIDIA_SMI} is not on PATH")
        else:
            logger.info("GPU memory source: %s (%s)", NVIDIA_SMI, executable)
            return GpuMemoryReader(NvidiaSmiSource(executable, exec_=exec_))
    message = "GPU introspection is not configured: " + "; ".join(reasons)
    logger.warning("%s", message)
    return GpuMemoryReader(None, unavailable=message)
