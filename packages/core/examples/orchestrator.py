"""A custom orchestrator in one page: haru-core decides, the supervisors act.

Needs only ``pip install haru-core haru-supervisor-client``. Run it with a fleet layout and the
domain to make active::

    python orchestrator.py layout.json beta [--token-file PATH]

The supervisors' token comes from ``HARU_SUPERVISOR_TOKEN`` or a file, never from an
argument: every user of the machine sees a command line (``ps``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from haru_core import (
    CreateOperation,
    decide_promotion,
    gpus_not_released,
    layout_id,
    models_not_in,
    plan_for,
    snapshot_from_layout,
    training_not_idle,
    training_not_running,
)
from haru_protocol import DomainSnapshot, DomainState, FleetLayout, OperationStep
from haru_supervisor_client import SupervisorCallError, SupervisorClient


async def observe(client: SupervisorClient, layout: FleetLayout) -> dict[str, DomainState]:
    """Every domain whose supervisor answers is ready; the others stay provisioning."""
    states: dict[str, DomainState] = {}
    for domain in layout.domains:
        if domain.supervisor_url is None:
            continue
        try:
            await client.status(domain.supervisor_url, timeout_s=10)
        except SupervisorCallError:
            continue
        states[domain.slug] = DomainState.READY
    return states


async def prove(
    what: str, check: Callable[[], Awaitable[Sequence[object]]], timeout_s: float
) -> None:
    """Poll ``check`` until it names nothing left unproven (haru-core's proofs), or give up."""
    deadline = time.monotonic() + timeout_s
    while left := await check():
        if time.monotonic() >= deadline:
            raise SystemExit(f"{what} not proven after {timeout_s:.0f}s: {list(left)}")
        await asyncio.sleep(0.1)


class Proofs:
    """What one domain's supervisor does not prove yet, per step (empty = proven)."""

    def __init__(self, client: SupervisorClient, domain: DomainSnapshot) -> None:
        assert domain.supervisor_url is not None
        self.client, self.domain, self.url = client, domain, domain.supervisor_url

    async def training_left(self) -> list[int]:
        return training_not_idle(self.domain, await self.client.status(self.url, timeout_s=10))

    async def training_not_started(self) -> list[int]:
        status = await self.client.status(self.url, timeout_s=10)
        return training_not_running(self.domain, status)

    async def gpus_held(self) -> list[int]:
        return gpus_not_released(self.domain, await self.client.gpu_memory(self.url, timeout_s=10))

    async def not_awake(self) -> list[str]:
        status = await self.client.status(self.url, timeout_s=10)
        return models_not_in(self.domain, status, asleep=False)

    async def not_asleep(self) -> list[str]:
        status = await self.client.status(self.url, timeout_s=10)
        return models_not_in(self.domain, status, asleep=True)


async def promote(layout: FleetLayout, target: str, *, token: str | None) -> FleetLayout:
    """Make ``target`` the active domain; returns the layout with the new active domain."""
    async with aiohttp.ClientSession() as session:
        client = SupervisorClient(session, token=token)
        # 1. A snapshot from the layout and what the supervisors answer.
        states = await observe(client, layout)
        fleet = snapshot_from_layout(layout, now=datetime.now(UTC), states=states)
        # 2. The decision (the same rules the control server applies).
        decision = decide_promotion(fleet, layout_id(layout.slug, target))
        if not isinstance(decision, CreateOperation):
            print(f"nothing to do: {decision}")
            return layout
        new = fleet.domain(decision.target_domain_id)
        old = fleet.active_domain
        assert new is not None
        policy = fleet.policy

        def url_of(domain: DomainSnapshot) -> str:
            assert domain.supervisor_url is not None
            return domain.supervisor_url

        wanted = Proofs(client, new)
        source = Proofs(client, old) if old is not None else None

        # 3. The plan, step by step: a supervisor call, then the proof the server waits for.
        for step in plan_for(decision.kind):
            match step:
                case OperationStep.STOP_TRAINING:
                    grace = policy.training_stop_grace_ms
                    await client.stop_training(url_of(new), timeout_s=10, grace_ms=grace)
                    budget_s = policy.stop_training_timeout_ms / 1000
                    await prove("training stopped", wanted.training_left, budget_s)
                case OperationStep.VERIFY_GPU:
                    budget_s = policy.verify_gpu_timeout_ms / 1000
                    await prove("GPU memory released", wanted.gpus_held, budget_s)
                case OperationStep.WAKE_VLLM:
                    await client.wake(url_of(new), timeout_s=policy.wake_timeout_ms / 1000)
                    await prove("models awake", wanted.not_awake, policy.wake_timeout_ms / 1000)
                case OperationStep.PROBE:
                    probe = await client.probe(
                        url_of(new),
                        timeout_s=policy.probe_timeout_ms / 1000,
                        prompt=policy.probe.prompt,
                        max_tokens=policy.probe.max_tokens,
                    )
                    if not probe.ok:
                        raise SystemExit(f"probe failed: {probe.results}")
                case OperationStep.SWITCH_ACTIVE:
                    # The commit point: point your router at the new domain here.
                    layout = layout.model_copy(update={"active_domain_slug": new.slug})
                case OperationStep.DEMOTE_OLD_SLEEP if source is not None:
                    # Once your router no longer sends it requests: drain, then sleep.
                    budget_s = policy.sleep_timeout_ms / 1000
                    drain_ms = policy.sleep_timeout_ms * 3 // 4
                    await client.sleep(source.url, timeout_s=budget_s, drain_timeout_ms=drain_ms)
                    await prove("old models asleep", source.not_asleep, budget_s)
                case OperationStep.DEMOTE_OLD_TRAIN if source is not None:
                    await client.start_training(source.url, timeout_s=10)
                    budget_s = policy.start_training_timeout_ms / 1000
                    await prove("training running", source.training_not_started, budget_s)
            print(f"  done  {step.value}")
    return layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layout", type=Path, help="fleet layout JSON")
    parser.add_argument("target", help="slug of the domain to make active")
    parser.add_argument("--token-file", type=Path, help="file holding the supervisors' token")
    args = parser.parse_args()
    token = (
        args.token_file.read_text(encoding="utf-8").strip()
        if args.token_file is not None
        else os.environ.get("HARU_SUPERVISOR_TOKEN")
    )
    layout = FleetLayout.model_validate_json(args.layout.read_text(encoding="utf-8"))
    result = asyncio.run(promote(layout, args.target, token=token))
    print(json.dumps({"activeDomainSlug": result.active_domain_slug}))


if __name__ == "__main__":
    main()
