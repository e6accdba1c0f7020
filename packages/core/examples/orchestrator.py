"""A custom orchestrator in one page: haru-core decides, the supervisors act.

Needs only ``pip install haru-core haru-supervisor``. Run it with a fleet layout and the
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
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from haru_core import CreateOperation, decide_promotion, layout_id, plan_for, snapshot_from_layout
from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetLayout,
    OperationStep,
    TrainingRunState,
)
from haru_supervisor.client import SupervisorCallError, SupervisorClient


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


async def wait_training_idle(client: SupervisorClient, url: str, timeout_s: float) -> None:
    """Poll the supervisor until no training run is left (the GPUs are free)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await client.status(url, timeout_s=10)
        runs = [slot.training for slot in status.slots if slot.training is not None]
        if all(run.state is TrainingRunState.IDLE for run in runs):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"training on {url} did not stop in {timeout_s}s")


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

        # 3. The plan, step by step, each one a supervisor call.
        for step in plan_for(decision.kind):
            match step:
                case OperationStep.STOP_TRAINING:
                    grace = policy.training_stop_grace_ms
                    await client.stop_training(url_of(new), timeout_s=10, grace_ms=grace)
                    await wait_training_idle(client, url_of(new), grace / 1000 + 10)
                case OperationStep.VERIFY_GPU:
                    memory = await client.gpu_memory(url_of(new), timeout_s=10)
                    print(
                        "  gpus:",
                        ", ".join(f"{g.index}: {g.used_mib:.0f} MiB" for g in memory.gpus),
                    )
                case OperationStep.WAKE_VLLM:
                    await client.wake(url_of(new), timeout_s=policy.wake_timeout_ms / 1000)
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
                case OperationStep.DEMOTE_OLD_SLEEP if old is not None:
                    await client.sleep(url_of(old), timeout_s=policy.sleep_timeout_ms / 1000)
                case OperationStep.DEMOTE_OLD_TRAIN if old is not None:
                    await client.start_training(url_of(old), timeout_s=10)
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
