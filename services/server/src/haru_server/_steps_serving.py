"""The serving-side steps (DESIGN 7.3): wake the target's vLLM, probe it, switch routing to it.

``wake_vllm`` wakes the target's models and proves them awake, ``probe`` sends each model a
request and fails the operation naming every model that did not answer, and ``switch_active``
moves the fleet's routing pointer with one compare-and-swap and tells this process's proxy.
"""

from __future__ import annotations

from uuid import UUID

from haru_core import inference_bindings, models_not_in
from haru_protocol import (
    FailedModel,
    OperationErrorCode,
    OperationStepDone,
)

from haru_server._steps_base import (
    TO_PROBING,
    TO_SERVING,
    TO_WAKING,
    Done,
    Failed,
    Pending,
    StepContext,
    StepResult,
    apply_mirror,
    fresh_pointer,
    poll_until,
    read_fence,
    read_status,
    supervisor_call,
    supervisor_url,
)


async def wake_vllm(ctx: StepContext) -> StepResult:
    target = ctx.target
    if not inference_bindings(target):
        return Failed(
            OperationErrorCode.NO_INFERENCE_BINDINGS,
            f"domain {target.slug!r} has no inference slot with a model binding",
        )
    url = supervisor_url(target)
    fence = await read_fence(ctx)
    if not ctx.entered:
        await apply_mirror(ctx, target, TO_WAKING)
    # Waking an awake vLLM is a harmless no-op, so no status read first (sleep differs:
    # sleeping again aborts queued requests).
    await supervisor_call(
        ctx, ctx.client.wake(url, timeout_s=ctx.bound(), fence=fence), target_side=True
    )
    asleep = await poll_until(
        ctx,
        lambda: read_status(ctx, target),
        lambda status: models_not_in(target, status, asleep=False),
        target_side=True,
    )
    if asleep:
        return Pending(f"model(s) not proven awake: {asleep}")
    models = tuple(b.name for b in inference_bindings(target))
    return Done(OperationStepDone(step=ctx.step, models=models), mirror=TO_PROBING)


async def probe_models(ctx: StepContext) -> StepResult:
    target = ctx.target
    url = supervisor_url(target)
    # A supervisor restarted since the wake (its vLLM servers still starting, or their state
    # not read yet) cannot prove them awake: that is "not ready yet", retried within the
    # budget (step_timeout at its end), not a probe_failed naming models that never answered.
    status = await supervisor_call(ctx, read_status(ctx, target), target_side=True)
    not_ready = models_not_in(target, status, asleep=False)
    if not_ready:
        return Pending(f"model(s) not ready yet (not reported awake): {not_ready}")
    probe = ctx.fleet.policy.probe
    response = await supervisor_call(
        ctx,
        # The client gives each model a bound comfortably inside this one, so a slow model
        # comes back as a failed result naming it.
        ctx.client.probe(
            url, timeout_s=ctx.bound(), prompt=probe.prompt, max_tokens=probe.max_tokens
        ),
        target_side=True,
    )
    results = {r.model: r for r in response.results}
    failed: list[FailedModel] = []
    latencies: dict[str, float] = {}
    for binding in inference_bindings(target):
        result = results.get(binding.name)
        if result is None:
            failed.append(FailedModel(model=binding.name, error="never probed"))
        elif not result.ok:
            failed.append(FailedModel(model=binding.name, error=result.error or "failed"))
        else:
            latencies[binding.name] = result.latency_ms
    if failed:
        problems = ", ".join(f"{f.model} ({f.error})" for f in failed)
        return Failed(OperationErrorCode.PROBE_FAILED, "probe failed: " + problems, tuple(failed))
    return Done(OperationStepDone(step=ctx.step, latency_ms=latencies), mirror=TO_SERVING)


async def switch_active(ctx: StepContext) -> StepResult:
    fleet, op, target = ctx.fleet, ctx.operation, ctx.target
    current = await fresh_pointer(ctx)
    if current.active_domain_id == target.id:
        return Done(
            OperationStepDone(
                step=ctx.step, already_active=True, route_revision=current.route_revision
            )
        )
    switched = await ctx.store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=op.source_domain_id,
        target_domain_id=target.id,
        operation_id=op.id,
        at=ctx.now,
    )
    pointer = await ctx.store.get_fleet_route_pointer(str(fleet.id))
    revision = None if pointer is None else pointer.route_revision
    if pointer is not None and ctx.proxy is not None:
        ctx.proxy.note_route_move(pointer)
    if switched:
        # Its routing.switched event rode the switch's statement.
        return Done(OperationStepDone(step=ctx.step, route_revision=revision))
    if pointer is not None and pointer.active_domain_id == target.id:
        return Done(OperationStepDone(step=ctx.step, route_revision=revision))
    where = "gone" if pointer is None else _str(pointer.active_domain_id)
    return Failed(
        OperationErrorCode.CAS_LOST,
        f"routing pointer is {where}, expected {_str(op.source_domain_id)}; not switched",
    )


def _str(value: UUID | None) -> str | None:
    return None if value is None else str(value)
