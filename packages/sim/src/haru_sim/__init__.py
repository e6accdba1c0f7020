"""Emulated vLLM server and emulated trainer for running Haru without GPUs.

- :class:`VllmSim` runs one emulated ``vllm serve --enable-sleep-mode`` server
  (``VLLM_SERVER_DEV_MODE=1``) on a real socket: OpenAI chat/completions/embeddings/models
  with SSE, ``/health``, ``/metrics``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, parked
  requests while asleep, and injectable faults (:class:`Faults`), also reachable from other
  processes through ``/_sim/*`` control routes.
- :func:`create_vllm_app` builds the same server as an aiohttp app for ``aiohttp_client``.
- ``haru-sim-vllm`` (``python -m haru_sim.vllm``) runs it as a process; it prints
  ``haru-sim-vllm listening on HOST:PORT`` when ready (:func:`parse_listen_line`).
- ``haru-sim-trainer`` (``python -m haru_sim.trainer``) is a preemptible training job that
  checkpoints into ``HARU_CHECKPOINT_DIR`` (:func:`read_trainer_checkpoint`).

Depends on aiohttp only; no haru package.
"""

from haru_sim._config import (
    SLEEP_TAGS,
    Faults,
    FaultUpdate,
    ReasoningField,
    SleepMode,
    VllmSimConfig,
)
from haru_sim._engine import RecordedRequest
from haru_sim._errors import SimConfigError, SimError, SimStateError, SimUnsupportedError
from haru_sim._sim import VllmSim
from haru_sim._trainer import CHECKPOINT_FILE, TrainerCheckpoint, read_trainer_checkpoint
from haru_sim._vllm import create_vllm_app
from haru_sim._vllm_cli import parse_listen_line
from haru_sim._vllm_inference import embedding_vector

__all__ = (  # noqa: RUF022 - grouped by topic, sorted within each group
    # Emulated vLLM server
    "SLEEP_TAGS",
    "FaultUpdate",
    "Faults",
    "ReasoningField",
    "RecordedRequest",
    "SleepMode",
    "VllmSim",
    "VllmSimConfig",
    "create_vllm_app",
    "embedding_vector",
    "parse_listen_line",
    # Emulated trainer
    "CHECKPOINT_FILE",
    "TrainerCheckpoint",
    "read_trainer_checkpoint",
    # Errors
    "SimConfigError",
    "SimError",
    "SimStateError",
    "SimUnsupportedError",
)
