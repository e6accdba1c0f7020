"""Haru supervisor: the agent on each GPU host (vLLM sleep/wake, training runs, GPU memory).

It serves the API of DESIGN 6.4 to the control plane, drives the local vLLM servers' admin
routes on 127.0.0.1, runs one preemptible trainer per training slot in its own process group,
and reports GPU memory from NVML or ``nvidia-smi``. Run it with ``haru-supervisor``.

Package attributes load lazily (PEP 562), so ``import haru_supervisor.client`` (the client the
control plane uses to drive supervisors) never imports the supervisor's web application,
settings or trainers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY: dict[str, str] = {
    "create_app": "haru_supervisor._app",
    "GpuMemoryError": "haru_supervisor._errors",
    "GpuMemorySourceError": "haru_supervisor._errors",
    "GpuMemoryUnavailable": "haru_supervisor._errors",
    "SettingsError": "haru_supervisor._errors",
    "ShuttingDownError": "haru_supervisor._errors",
    "HaruSupervisorError": "haru_supervisor._errors",
    "TrainingStartError": "haru_supervisor._errors",
    "VllmAdminError": "haru_supervisor._errors",
    "NVIDIA_SMI_APPS_ARGS": "haru_supervisor._gpu",
    "NVIDIA_SMI_ARGS": "haru_supervisor._gpu",
    "NVIDIA_SMI_UUID_ARGS": "haru_supervisor._gpu",
    "SOURCE_HEADER": "haru_supervisor._gpu",
    "GpuMemoryReader": "haru_supervisor._gpu",
    "GpuMemorySource": "haru_supervisor._gpu",
    "NvidiaSmiSource": "haru_supervisor._gpu",
    "NvmlApi": "haru_supervisor._gpu",
    "NvmlLoader": "haru_supervisor._gpu",
    "NvmlMemory": "haru_supervisor._gpu",
    "NvmlSource": "haru_supervisor._gpu",
    "load_pynvml": "haru_supervisor._gpu",
    "open_gpu_reader": "haru_supervisor._gpu",
    "parse_nvidia_smi_apps": "haru_supervisor._gpu",
    "parse_nvidia_smi_memory": "haru_supervisor._gpu",
    "parse_nvidia_smi_uuids": "haru_supervisor._gpu",
    "process_name": "haru_supervisor._gpu",
    "GPU_SOURCES": "haru_supervisor._settings",
    "GpuSource": "haru_supervisor._settings",
    "Settings": "haru_supervisor._settings",
    "load_config": "haru_supervisor._settings",
    "load_settings": "haru_supervisor._settings",
    "resolve_api_keys": "haru_supervisor._settings",
    "trainer_base_env": "haru_supervisor._settings",
    "TrainingRun": "haru_supervisor._training",
    "TrainingRuns": "haru_supervisor._training",
    "SLEEP_LEVEL": "haru_supervisor._vllm",
    "VllmAdminClient": "haru_supervisor._vllm",
    "VllmTimeouts": "haru_supervisor._vllm",
    "sum_metrics": "haru_supervisor._vllm",
    "MIN_VLLM_VERSION": "haru_supervisor._vllm",
    "SLEEP_MODE": "haru_supervisor._vllm",
    "parse_vllm_version": "haru_supervisor._vllm",
    "version_refusal": "haru_supervisor._vllm",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
