"""Typed application keys: every piece of app state lives behind one of these."""

from __future__ import annotations

from aiohttp import web

from haru_supervisor._actions import AdminActions
from haru_supervisor._fence import FenceBook
from haru_supervisor._gpu import GpuMemoryReader
from haru_supervisor._settings import Settings
from haru_supervisor._training import TrainingRuns
from haru_supervisor._vllm import VllmAdminClient

settings_key = web.AppKey("settings", Settings)
vllm_key = web.AppKey("vllm", VllmAdminClient)
runs_key = web.AppKey("runs", TrainingRuns)
gpu_key = web.AppKey("gpu", GpuMemoryReader)
actions_key = web.AppKey("actions", AdminActions)
fences_key = web.AppKey("fences", FenceBook)
