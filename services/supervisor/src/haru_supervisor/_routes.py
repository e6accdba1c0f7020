"""The supervisor API (DESIGN 6.4)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Final

from aiohttp import web
from haru_protocol import (
    FENCE_HEADER,
    ErrorCode,
    FenceParseError,
    GpuMemoryResponse,
    Health,
    ModelStatus,
    OkResponse,
    ProbeRequest,
    ProbeResponse,
    ReadyResponse,
    SleepRequest,
    SlotKind,
    SlotStatus,
    SupervisorConfig,
    SupervisorFence,
    SupervisorInferenceSlot,
    SupervisorModel,
    SupervisorStatus,
    TrainingRunState,
    TrainingStatus,
    TrainingStatusResponse,
    TrainingStopRequest,
    WakeRequest,
    WireModel,
)
from haru_web import ApiError, json_model, parse_body

from haru_supervisor._actions import BOTH, TRAINING, VLLM
from haru_supervisor._errors import (
    GpuMemorySourceError,
    GpuMemoryUnavailable,
    ShuttingDownError,
    TrainingStartError,
    VllmAdminError,
)
from haru_supervisor._gpu import SOURCE_HEADER
from haru_supervisor._keys import (
    actions_key,
    fences_key,
    gpu_key,
    runs_key,
    settings_key,
    vllm_key,
)
from haru_supervisor._metrics import admin_call, metrics_key

logger = logging.getLogger(__name__)

DEFAULT_PROBE_TIMEOUT_S: Final = 30.0
"""Bound of each probe completion when the request names none (the first request after a
wake is several times slower than the next ones)."""

_REASON_LIMIT: Final = 300

MAX_BODY_BYTES: Final = 64 * 1024
"""Every request body of this API is a few keys; anything larger is refused (413)."""

routes = web.RouteTableDef()


class NoParameters(WireModel):
    """Body of an action without parameters: empty or ``{}`` (any key is unknown)."""


def _config(request: web.Request) -> SupervisorConfig:
    return request.app[settings_key].config


def _target_models(config: SupervisorConfig, gpu_index: int | None) -> tuple[SupervisorModel, ...]:
    slots: Sequence[SupervisorInferenceSlot] = config.inference_slots
    if gpu_index is not None:
        slots = [slot for slot in slots if slot.gpu_index == gpu_index]
        if not slots:
            raise ApiError(
                ErrorCode.INVALID_TARGET,
                f"no inference slot on GPU {gpu_index}",
                status=404,
            )
    return tuple(model for slot in slots for model in slot.models)


async def _attempt_all(
    action: str, calls: Sequence[tuple[SupervisorModel, Awaitable[None]]]
) -> None:
    """Run every call concurrently, all to completion, then report each failed model (502)."""
    outcomes = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
    failures: list[str] = []
    for (model, _), outcome in zip(calls, outcomes, strict=True):
        if isinstance(outcome, VllmAdminError):
            reason = outcome.reason
            if len(reason) > _REASON_LIMIT:
                reason = reason[:_REASON_LIMIT] + "..."
            failures.append(f"{model.name} ({reason})")
        elif isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome  # cancellation and the like: never swallowed
            logger.error("%s %s failed unexpectedly", action, model.name, exc_info=outcome)
            failures.append(f"{model.name} (internal error)")
    if failures:
        logger.warning("%s failed for %s", action, ", ".join(failures))
        raise ApiError(
            ErrorCode.UPSTREAM_UNREACHABLE,
            f"{action} failed for {len(failures)} of {len(calls)} model(s): " + "; ".join(failures),
        )


@routes.get("/healthz")
async def healthz(_request: web.Request) -> web.Response:
    return json_model(Health(ok=True))


async def _model_statuses(request: web.Request) -> dict[str, ModelStatus]:
    client = request.app[vllm_key]
    models = [model for slot in _config(request).inference_slots for model in slot.models]
    statuses = await asyncio.gather(*(client.status(model) for model in models))
    return {model.name: status for model, status in zip(models, statuses, strict=True)}


def _ready(statuses: dict[str, ModelStatus]) -> bool:
    return bool(statuses) and all(status.sleeping is False for status in statuses.values())


@routes.get("/v1/status")
async def status(request: web.Request) -> web.Response:
    runs = request.app[runs_key]
    statuses, trainings = await asyncio.gather(_model_statuses(request), runs.statuses())
    by_gpu = {training.gpu_index: training for training in trainings}
    slots: list[SlotStatus] = []
    for slot in _config(request).slots:
        if isinstance(slot, SupervisorInferenceSlot):
            entry = SlotStatus(
                gpu_index=slot.gpu_index,
                kind=SlotKind.INFERENCE,
                models=tuple(statuses[model.name] for model in slot.models),
            )
        else:
            training = by_gpu[slot.gpu_index]
            entry = SlotStatus(
                gpu_index=slot.gpu_index,
                kind=SlotKind.TRAINING,
                training=TrainingStatus(
                    state=training.state, pids=training.pids, last_stop=training.last_stop
                ),
            )
        slots.append(entry)
    body = SupervisorStatus(slots=tuple(slots), ready=_ready(statuses))
    # `models` and `training` are absent (not null) on slots they do not apply to, while a
    # model's `sleeping` stays null when its server proved nothing.
    absent = {
        index: {name for name in ("models", "training") if getattr(slot, name) is None}
        for index, slot in enumerate(slots)
    }
    return web.json_response(text=body.model_dump_json(exclude={"slots": absent}))


@routes.get("/v1/ready")
async def ready(request: web.Request) -> web.Response:
    return json_model(ReadyResponse(ready=_ready(await _model_statuses(request))))


def _inference_gpus(config: SupervisorConfig, gpu_index: int | None) -> tuple[int, ...]:
    return tuple(
        slot.gpu_index
        for slot in config.inference_slots
        if gpu_index is None or slot.gpu_index == gpu_index
    )


def _training_gpus(config: SupervisorConfig) -> tuple[int, ...]:
    return tuple(slot.gpu_index for slot in config.training_slots)


def admit_fence(request: web.Request, action: str) -> SupervisorFence | None:
    """Check the request's ``X-Haru-Fence`` before a state-changing ``action``.

    Returns:
        The admitted fence, or None for a call without one (accepted, logged).

    Raises:
        ApiError: 400 ``invalid_request`` for a malformed or repeated header; 409
            ``stale_fence`` when a higher token was seen for the fleet.
    """
    values = request.headers.getall(FENCE_HEADER, [])
    if not values:
        logger.info("%s without %s (not fenced: an operator's direct call?)", action, FENCE_HEADER)
        return None
    if len(values) > 1:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{FENCE_HEADER} given more than once")
    try:
        fence = SupervisorFence.parse(values[0])
    except FenceParseError as exc:
        # The message never quotes the value (it is the client's, newlines included).
        raise ApiError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
    seen = request.app[fences_key].admit(fence)
    if seen is not None:
        raise _stale(fence, seen, action)
    return fence


def _stale(fence: SupervisorFence, seen: int, action: str) -> ApiError:
    """The 409 ``stale_fence`` of ``action`` (logged): ``seen`` is newer than ``fence``."""
    logger.warning(
        "refused %s for fleet %s: fence %d is older than %d (the caller lost its step)",
        action,
        fence.fleet_id,
        fence.token,
        seen,
    )
    return ApiError(
        ErrorCode.STALE_FENCE,
        f"{action} refused: fence {fence.token} of fleet {fence.fleet_id} is older than "
        f"{seen}, the newest this supervisor has seen; the caller lost its operation step",
        status=409,
    )


# Every admin action below runs through `actions_key`: one at a time per GPU it touches and lane
# (`_actions`), and a request identical to one already queued or running joins it (same answer
# for all).


@routes.post("/v1/vllm/sleep")
@admin_call("sleep")
async def vllm_sleep(request: web.Request) -> web.Response:
    admit_fence(request, "sleep")
    body = await parse_body(request, SleepRequest, limit=MAX_BODY_BYTES, empty_ok=True)
    config = _config(request)
    models = _target_models(config, body.gpu_index)
    client = request.app[vllm_key]
    drain_s = None if body.drain_timeout_ms is None else body.drain_timeout_ms / 1000

    async def sleep() -> None:
        await _attempt_all(
            "sleep", [(model, client.sleep(model, drain_timeout_s=drain_s)) for model in models]
        )

    key = ("sleep", body.gpu_index, body.drain_timeout_ms)
    await request.app[actions_key].run(
        key, _inference_gpus(config, body.gpu_index), sleep, lanes=VLLM
    )
    return json_model(OkResponse())


@routes.post("/v1/vllm/wake")
@admin_call("wake")
async def vllm_wake(request: web.Request) -> web.Response:
    admit_fence(request, "wake")
    body = await parse_body(request, WakeRequest, limit=MAX_BODY_BYTES, empty_ok=True)
    config = _config(request)
    models = _target_models(config, body.gpu_index)
    client = request.app[vllm_key]
    runs = request.app[runs_key]
    gpus = _inference_gpus(config, body.gpu_index)

    async def wake() -> None:
        # Checked under the GPUs' locks: a training start queued before this wake has run.
        busy = [
            f"GPU {run.gpu_index} ({run.state.value})"
            for gpu in gpus
            if (run := runs.by_gpu(gpu)) is not None and run.state is not TrainingRunState.IDLE
        ]
        if busy:
            raise ApiError(
                ErrorCode.OPERATION_CONFLICT,
                "refusing to wake vLLM: training is not idle on "
                + ", ".join(busy)
                + "; stop training and wait for it to be idle first",
                status=409,
            )
        await _attempt_all("wake", [(model, client.wake(model)) for model in models])

    await request.app[actions_key].run(("wake", body.gpu_index), gpus, wake, lanes=VLLM)
    return json_model(OkResponse())


@routes.post("/v1/training/start")
@admin_call("training_start")
async def training_start(request: web.Request) -> web.Response:
    fence = admit_fence(request, "training start")
    await parse_body(request, NoParameters, limit=MAX_BODY_BYTES, empty_ok=True)
    runs = request.app[runs_key]
    fences = request.app[fences_key]

    async def start() -> list[TrainingStartError]:
        # A stop does not queue behind a sleep or wake (its own lane): a start that waited
        # there may find that a newer step stopped training meanwhile. It must not undo that.
        if fence is not None:
            seen = fences.highest(fence.fleet_id)
            if seen is not None and seen > fence.token:
                raise _stale(fence, seen, "training start")
        return await runs.start_all()

    try:
        # Starts of different steps never join: each is checked against its own fence.
        failures = await request.app[actions_key].run(
            ("training.start", None if fence is None else (fence.fleet_id, fence.token)),
            _training_gpus(_config(request)),
            start,
            lanes=BOTH,
        )
    except ShuttingDownError as exc:
        raise ApiError(ErrorCode.SHUTTING_DOWN, str(exc)) from exc
    if failures:
        raise ApiError(
            ErrorCode.INTERNAL_ERROR,
            "training could not start: " + "; ".join(str(failure) for failure in failures),
        )
    return json_model(OkResponse())


@routes.post("/v1/training/stop")
@admin_call("training_stop")
async def training_stop(request: web.Request) -> web.Response:
    admit_fence(request, "training stop")
    body = await parse_body(request, TrainingStopRequest, limit=MAX_BODY_BYTES, empty_ok=True)
    settings = request.app[settings_key]
    grace_s = settings.stop_grace_s if body.grace_ms is None else body.grace_ms / 1000
    runs = request.app[runs_key]

    async def stop() -> None:
        await runs.stop_all(grace_s)

    key = ("training.stop", body.grace_ms)
    await request.app[actions_key].run(key, _training_gpus(_config(request)), stop, lanes=TRAINING)
    return json_model(OkResponse(), status=202)


@routes.get("/v1/training/status")
async def training_status(request: web.Request) -> web.Response:
    return json_model(TrainingStatusResponse(slots=await request.app[runs_key].statuses()))


@routes.get("/v1/gpu/memory")
@routes.get("/v1/gpu/processes")
async def gpu_memory(request: web.Request) -> web.Response:
    reader = request.app[gpu_key]
    with_processes = request.path.endswith("/processes")
    try:
        gpus = await (reader.read_with_processes() if with_processes else reader.read())
    except GpuMemoryUnavailable as exc:
        raise ApiError(ErrorCode.NOT_IMPLEMENTED, str(exc)) from exc
    except GpuMemorySourceError as exc:
        raise ApiError(ErrorCode.UPSTREAM_UNREACHABLE, str(exc)) from exc
    source = reader.source
    headers = {SOURCE_HEADER: source.name} if source is not None else None
    return json_model(GpuMemoryResponse(gpus=gpus), headers=headers)


@routes.post("/v1/probe")
@admin_call("probe")
async def probe(request: web.Request) -> web.Response:
    body = await parse_body(request, ProbeRequest, limit=MAX_BODY_BYTES, empty_ok=True)
    timeout_s = DEFAULT_PROBE_TIMEOUT_S if body.timeout_ms is None else body.timeout_ms / 1000
    client = request.app[vllm_key]
    models = [model for slot in _config(request).inference_slots for model in slot.models]
    results = await asyncio.gather(
        *(
            client.probe(model, prompt=body.prompt, max_tokens=body.max_tokens, timeout_s=timeout_s)
            for model in models
        )
    )
    request.app[metrics_key].probed(tuple(results))
    ok = bool(results) and all(result.ok for result in results)
    return json_model(ProbeResponse(ok=ok, results=tuple(results)))
