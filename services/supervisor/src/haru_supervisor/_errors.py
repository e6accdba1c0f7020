"""Errors raised by haru-supervisor.

Hierarchy::

    HaruSupervisorError            root of every error this package raises
    ├── SettingsError              the environment or the config document is invalid (exit 2)
    ├── VllmAdminError             one local vLLM server refused, failed or did not answer
    ├── TrainingStartError         a trainer could not be spawned (its run stays idle)
    ├── ShuttingDownError          the supervisor is shutting down and refuses new starts
    └── GpuMemoryError             GPU memory could not be read
        ├── GpuMemoryUnavailable   no source is usable on this host (HTTP 501)
        └── GpuMemorySourceError   the source ran but failed or printed nonsense (HTTP 502)
"""

from __future__ import annotations


class HaruSupervisorError(Exception):
    """Root of every error raised by haru-supervisor."""


class SettingsError(HaruSupervisorError):
    """The environment or the config document is invalid; the supervisor cannot start."""


class VllmAdminError(HaruSupervisorError):
    """A call to one local vLLM server failed.

    Attributes:
        model: The served model name of that server.
        reason: A short, bounded explanation (no response body beyond a bounded excerpt).
        unfinished: The request may have reached vLLM and still be running there (it timed
            out, or the connection dropped after it was sent): its outcome is unknown.
    """

    def __init__(self, model: str, reason: str, *, unfinished: bool = False) -> None:
        super().__init__(f"{model}: {reason}")
        self.model = model
        self.reason = reason
        self.unfinished = unfinished


class TrainingStartError(HaruSupervisorError):
    """A training slot's command could not be spawned; its run is back to idle.

    Attributes:
        gpu_index: The slot's GPU.
        reason: Why (missing binary, no permission), bounded.
    """

    def __init__(self, gpu_index: int, reason: str) -> None:
        super().__init__(f"GPU {gpu_index}: {reason}")
        self.gpu_index = gpu_index
        self.reason = reason


class ShuttingDownError(HaruSupervisorError):
    """The supervisor is shutting down: no training run may start."""


class GpuMemoryError(HaruSupervisorError):
    """GPU memory could not be read."""


class GpuMemoryUnavailable(GpuMemoryError):  # noqa: N818  (a state, not an event; reads better)
    """No GPU memory source is usable on this host (no NVML, no ``nvidia-smi``)."""


class GpuMemorySourceError(GpuMemoryError):
    """The GPU memory source ran but failed, timed out, or printed something unparsable."""
