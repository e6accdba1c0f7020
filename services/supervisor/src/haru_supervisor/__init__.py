"""Haru supervisor: the agent on each GPU host (vLLM sleep/wake, training runs, GPU memory).

It serves the API of SPEC 6.4 to the control plane, drives the local vLLM servers' admin
routes on 127.0.0.1, runs one preemptible trainer per training slot in its own process group,
and reports GPU memory from NVML or ``nvidia-smi``. Run it with ``haru-supervisor``.
"""

from haru_supervisor._app import create_app
from haru_supervisor._errors import (
    GpuMemoryError,
    GpuMemorySourceError,
    GpuMemoryUnavailable,
    HaruSupervisorError,
    SettingsError,
    ShuttingDownError,
    TrainingStartError,
    VllmAdminError,
)
from haru_supervisor._gpu import (
    NVIDIA_SMI_APPS_ARGS,
    NVIDIA_SMI_ARGS,
    NVIDIA_SMI_UUID_ARGS,
    SOURCE_HEADER,
    GpuMemoryReader,
    GpuMemorySource,
    NvidiaSmiSource,
    NvmlApi,
    NvmlLoader,
    NvmlMemory,
    NvmlSource,
    load_pynvml,
    open_gpu_reader,
    parse_nvidia_smi_apps,
    parse_nvidia_smi_memory,
    parse_nvidia_smi_uuids,
    process_name,
)
from haru_supervisor._settings import (
    GPU_SOURCES,
    GpuSource,
    Settings,
    load_config,
    load_settings,
    trainer_base_env,
)
from haru_supervisor._training import TrainingRun, TrainingRuns
from haru_supervisor._vllm import (
    SLEEP_LEVEL,
    VllmAdminClient,
    VllmTimeouts,
    sum_metrics,
)

__all__ = (
    "GPU_SOURCES",
    "NVIDIA_SMI_APPS_ARGS",
    "NVIDIA_SMI_ARGS",
    "NVIDIA_SMI_UUID_ARGS",
    "SLEEP_LEVEL",
    "SOURCE_HEADER",
    "GpuMemoryError",
    "GpuMemoryReader",
    "GpuMemorySource",
    "GpuMemorySourceError",
    "GpuMemoryUnavailable",
    "GpuSource",
    "HaruSupervisorError",
    "NvidiaSmiSource",
    "NvmlApi",
    "NvmlLoader",
    "NvmlMemory",
    "NvmlSource",
    "Settings",
    "SettingsError",
    "ShuttingDownError",
    "TrainingRun",
    "TrainingRuns",
    "TrainingStartError",
    "VllmAdminClient",
    "VllmAdminError",
    "VllmTimeouts",
    "create_app",
    "load_config",
    "load_pynvml",
    "load_settings",
    "open_gpu_reader",
    "parse_nvidia_smi_apps",
    "parse_nvidia_smi_memory",
    "parse_nvidia_smi_uuids",
    "process_name",
    "sum_metrics",
    "trainer_base_env",
)
