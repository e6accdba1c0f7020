"""The supervisor's Python API: what embedding code and tests import.

Importing this module loads the whole supervisor (its application, settings, trainers, the
vLLM admin client and the GPU readers); the package's ``__init__`` stays empty so
``haru-gateway`` starts without them.
"""

from __future__ import annotations

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
    resolve_api_keys,
    trainer_base_env,
)
from haru_supervisor._training import TrainingRun, TrainingRuns
from haru_supervisor._vllm import (
    MIN_VLLM_VERSION,
    SLEEP_LEVEL,
    SLEEP_MODE,
    VllmAdminClient,
    VllmTimeouts,
    parse_vllm_version,
    sum_metrics,
    version_refusal,
)

__all__ = (
    "GPU_SOURCES",
    "MIN_VLLM_VERSION",
    "NVIDIA_SMI_APPS_ARGS",
    "NVIDIA_SMI_ARGS",
    "NVIDIA_SMI_UUID_ARGS",
    "SLEEP_LEVEL",
    "SLEEP_MODE",
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
    "parse_vllm_version",
    "process_name",
    "resolve_api_keys",
    "sum_metrics",
    "trainer_base_env",
    "version_refusal",
)
