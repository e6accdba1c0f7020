"""Switchovers of a whole local fleet (real server, supervisors, emulated vLLM and trainers).

Every process is real and separate; traffic goes through the server's proxy with the OpenAI
SDK; the proofs come from the processes themselves (sleep state of each emulated vLLM server,
the supervisors' training runs, trainer checkpoints), not only from the server's snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from haru_demo import (
    ChatTraffic,
    DemoTopology,
    active_slug,
    fetch_events,
    is_standby_posture,
    promote_budget_s,
)
from haru_protocol import InferenceSlotState, OperationKind, OperationState, TrainingRunState
from haru_sim import read_trainer_checkpoint

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow


def traffic_for(topology: DemoTopology, *, clients: int = 4) -> ChatTraffic:
    models = topology.domains[topology.initial_active()].models
    return ChatTraffic(
        topology.server_url, fleet=topology.fleet_slug, models=models, clients=clients, pause_s=0.02
    )


async def served(topology: DemoTopology, slug: str) -> int:
    states = await topology.vllm_states(slug)
    total = 0
    for state in states.values():
        assert state is not None, f"a vLLM server of {slug} does not answer"
        counters = state["counters"]
        assert isinstance(counters, dict)
        total += int(counters["requests"].get("/v1/chat/completions", 0))
    return total


async def parked(topology: DemoTopology, slug: str) -> int:
    """Requests that reached ``slug``'s vLLM servers while asleep or falling asleep."""
    total = 0
    for state in (await topology.vllm_states(slug)).values():
        assert state is not None, f"a vLLM server of {slug} does not answer"
        counters = state["counters"]
        assert isinstance(counters, dict)
        total += int(counters["parked"])
    return total


async def asleep(topology: DemoTopology, slug: str) -> bool:
    states = await topology.vllm_states(slug)
    return all(s is not None and s["sleeping"] is True for s in states.values())


async def training_runs(topology: DemoTopology, slug: str) -> bool:
    status = await topology.training_status(slug)
    return bool(status.slots) and all(
        s.state is TrainingRunState.RUNNING and s.pids for s in status.slots
    )


def checkpoint_steps(topology: DemoTopology, slug: str) -> dict[int, int]:
    steps = {}
    for gpu, directory in topology.domains[slug].checkpoint_dirs.items():
        checkpoint = read_trainer_checkpoint(directory)
        steps[gpu] = -1 if checkpoint is None else checkpoint.step
    return steps


async def test_planned_promotion_under_load_fails_no_request(
    launch: Launch, eventually: Eventually
) -> None:
    topology = await launch()
    fleet = await topology.fleet()
    assert active_slug(fleet) == "alpha"
    assert is_standby_posture(fleet, "beta")
    assert await asleep(topology, "beta")
    assert await training_runs(topology, "beta")
    served_before = await served(topology, "beta")

    def checkpointed() -> dict[int, int] | None:
        steps = checkpoint_steps(topology, "beta")
        return steps if min(steps.values()) > 0 else None

    trained = await eventually(checkpointed, what="beta's trainers to checkpoint")

    async with traffic_for(topology) as traffic:
        await eventually(lambda: sum(r.ok for r in traffic.records) >= 20, what="traffic")
        accepted = await topology.request(OperationKind.PROMOTE, "beta")
        assert accepted is not None
        final = await topology.wait_for_operation(accepted.id, timeout_s=60)
        switched = time.time()
        await eventually(
            lambda: sum(r.started_at > switched for r in traffic.records) >= 20,
            what="traffic on the new active",
        )

    assert final.state is OperationState.SUCCEEDED, final.error
    failures = [r for r in traffic.records if not r.ok]
    assert not failures, (switched, failures)
    assert not any(r.stale for r in traffic.records)
    assert {r.stream for r in traffic.records} == {True, False}
    fleet = await topology.fleet()
    assert active_slug(fleet) == "beta"
    assert await served(topology, "beta") > served_before
    # The promote's best-effort tail put the old active into standby posture.
    fleet = await topology.wait_for_fleet(
        lambda f: is_standby_posture(f, "alpha"), what="alpha in standby posture", timeout_s=30
    )
    assert await asleep(topology, "alpha")
    # No request reached the old active while it slept or was going to sleep (the strict
    # emulator parks those until the next wake, as vLLM does).
    for name, state in (await topology.vllm_states("alpha")).items():
        assert state is not None
        counters = state["counters"]
        assert isinstance(counters, dict)
        assert (counters["arrived_while_sleeping"], counters["parked"]) == (0, 0), name
    assert await training_runs(topology, "alpha")
    # beta's trainers were stopped with SIGTERM and flushed a final checkpoint.
    status = await topology.training_status("beta")
    assert all(s.state is TrainingRunState.IDLE and not s.pids for s in status.slots)
    final_steps = checkpoint_steps(topology, "beta")
    assert all(final_steps[gpu] >= step for gpu, step in trained.items()), (trained, final_steps)


async def test_planned_switchovers_never_send_a_request_to_a_sleeping_server(
    launch: Launch, eventually: Eventually
) -> None:
    """Back and forth under load: the old active is put to sleep only once no process routes
    to it any more (its route lease ran out), so it never sees a request while it sleeps."""
    topology = await launch()
    assert active_slug(await topology.fleet()) == "alpha"
    assert (await parked(topology, "alpha"), await parked(topology, "beta")) == (0, 0)

    async with traffic_for(topology, clients=8) as traffic:
        await eventually(lambda: sum(r.ok for r in traffic.records) >= 20, what="traffic")
        for target, old in (("beta", "alpha"), ("alpha", "beta")):
            accepted = await topology.request(OperationKind.PROMOTE, target)
            assert accepted is not None
            final = await topology.wait_for_operation(accepted.id, timeout_s=60)
            assert final.state is OperationState.SUCCEEDED, final.error
            await eventually(lambda old=old: asleep(topology, old), what=f"{old} asleep")
            switched = time.time()
            await eventually(
                lambda switched=switched: (
                    sum(r.started_at > switched for r in traffic.records) >= 20
                ),
                what=f"traffic on {target}",
            )

    assert active_slug(await topology.fleet()) == "alpha"
    failures = [r for r in traffic.records if not r.ok]
    assert not failures, failures
    assert await parked(topology, "alpha") == 0
    assert await parked(topology, "beta") == 0
    assert await served(topology, "beta") > 0


async def test_unplanned_failover_happens_within_its_budget(
    launch: Launch, eventually: Eventually
) -> None:
    topology = await launch()
    fleet = await topology.fleet()
    policy = fleet.policy
    budget_s = (policy.degraded_grace_ms + policy.heartbeat_stale_ms) / 1000 + promote_budget_s(
        policy
    )
    async with traffic_for(topology) as traffic:
        await eventually(lambda: sum(r.ok for r in traffic.records) >= 10, what="traffic")
        killed = (await topology.kill_vllm("alpha")).timestamp()
        fleet = await topology.wait_for_fleet(
            lambda f: active_slug(f) == "beta", what="routing to move to beta", timeout_s=budget_s
        )
        first_good = await eventually(
            lambda: traffic.first_good_after(killed), what="a good answer from beta"
        )
        moved = time.time()
        await eventually(
            lambda: sum(r.started_at > moved + 0.5 for r in traffic.records) >= 20,
            what="traffic after the failover",
        )

    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug)
    auto = [e for e in events if e.type == "operation.auto_failover"]
    assert len(auto) == 1
    assert auto[0].created_at.timestamp() >= killed
    switched = [
        e for e in events if e.type == "routing.switched" and e.operation_id == auto[0].operation_id
    ]
    assert len(switched) == 1
    assert switched[0].created_at.timestamp() - killed <= budget_s
    assert first_good.ended_at - killed <= budget_s
    # Once routing moved, every request is answered by the new active.
    settled = switched[0].created_at.timestamp() + 0.5
    later = [r for r in traffic.records if r.started_at >= settled]
    assert later
    assert all(r.ok for r in later), [r for r in later if not r.ok]
    alpha = next(d for d in fleet.domains if d.slug == "alpha")
    assert all(
        s.state is InferenceSlotState.FAILED for s in alpha.slots if s.inference_spec is not None
    )


async def test_demote_returns_a_standby_to_standby_posture(
    launch: Launch, eventually: Eventually
) -> None:
    topology = await launch(standby_posture=False)
    fleet = await topology.fleet()
    beta = next(d for d in fleet.domains if d.slug == "beta")
    assert all(s.state.value == "idle" for s in beta.slots if s.training_spec is not None)
    assert not await training_runs(topology, "beta")
    # Its vLLM servers come back awake, as after a host reboot: not a standby posture.
    await topology.restart_vllm("beta", asleep=False)
    await topology.wait_for_fleet(
        lambda f: all(
            s.state is InferenceSlotState.FAILED
            for d in f.domains
            if d.slug == "beta"
            for s in d.slots
            if s.inference_spec is not None
        ),
        what="the heartbeat to flag beta's awake servers",
        timeout_s=30,
    )

    accepted = await topology.request(OperationKind.DEMOTE, "beta")
    assert accepted is not None
    final = await topology.wait_for_operation(accepted.id, timeout_s=60)

    assert final.state is OperationState.SUCCEEDED, final.error
    await topology.wait_for_fleet(
        lambda f: is_standby_posture(f, "beta"), what="beta in standby posture", timeout_s=30
    )
    assert await asleep(topology, "beta")
    assert await training_runs(topology, "beta")
    first = checkpoint_steps(topology, "beta")
    await eventually(
        lambda: all(step > first[gpu] for gpu, step in checkpoint_steps(topology, "beta").items()),
        what="trainers to checkpoint",
    )
    # alpha kept serving throughout.
    assert active_slug(await topology.fleet()) == "alpha"
    async with traffic_for(topology, clients=1) as traffic:
        await eventually(lambda: len(traffic.records) >= 3, what="a few answers")
    assert all(r.ok for r in traffic.records)
