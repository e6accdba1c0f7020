"""GPU memory (SPEC 6.6): NVML when it is installed and finds a GPU, else ``nvidia-smi``.

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
from collections.abc import Callable
from typing import Final, Protocol

from haru_exec import Exec, ExecError, format_exec_failure, run_exec
from haru_protocol import GpuMemory

from haru_supervisor._errors import GpuMemorySourceError, GpuMemoryUnavailable
from haru_supervisor._settings import GpuSource

logger = logging.getLogger(__name__)

NVIDIA_SMI: Final = "nvidia-smi"
NVIDIA_SMI_ARGS: Final = (
    "--query-gpu=index,memory.used,memory.total",
    "--format=csv,noheader,nounits",
)
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
        self._exec = exec_
        self._timeout_s = timeout_s

    @property
    def name(self) -> str:
        return "nvidia-smi"

    @property
    def argv(self) -> tuple[str, ...]:
        """The exact command run on each read."""
        return self._argv

    async def read(self) -> tuple[GpuMemory, ...]:
        try:
            result = await self._exec(self._argv, timeout=self._timeout_s)
        except ExecError as exc:
            raise GpuMemorySourceError(str(exc)) from exc
        if not result.ok:
            raise GpuMemorySourceError(format_exec_failure(result, limit=400))
        return parse_nvidia_smi_memory(result.stdout)

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
