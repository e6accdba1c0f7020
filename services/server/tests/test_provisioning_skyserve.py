"""The lifecycle of ``skyserve`` domains in the reconcile tick, against a fake ``sky serve``.

The fake ``sky`` is a real executable on a temp PATH, run through the real
:class:`~haru_driver_skyserve.SkyServeDriver` and runner. It answers like SkyPilot 0.14.1:
``sky serve status NAME`` prints the ``Services`` title and the table as
``format_service_table`` lays it out (left-aligned columns two spaces apart, trailing spaces,
ANSI-coloured STATUS, ``-`` for no endpoint) followed by the replica table, or ``No live
services.`` for an unknown name; a service goes CONTROLLER_INIT, REPLICA_INIT (0/N), then
READY with N/N replicas and an endpoint, unless a test sets its row. ``serve up`` fails or
hangs on request. As unkind as SkyServe 0.14.1: ``serve up`` of a service still listed fails
with "Service N already exists." (``sky/serve/service.py``); ``serve down`` only schedules
the termination (SHUTTING_DOWN for two more reads), skips a failed service without
``--purge``, and exits 1 "No live services." without a controller
(``sky/serve/serve_utils.py`` ``terminate_services``, ``sky/utils/controller_utils.py``).
Budgets run on the injected clock; the store is real.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import aiohttp
import pytest
import yaml
from haru_core import routable_models
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_driver_skypilot import SkyPilotDriver, SkyRunner
from haru_driver_skyserve import SkyServeDriver
from haru_protocol import (
    DomainSnapshot,
    DomainState,
    Event,
    EventType,
    FleetLayout,
    FleetSnapshot,
    InferenceSlotState,
    OperationKind,
    OperationState,
    OperationStep,
)
from haru_server._clock import ManualClock
from haru_server._provisioning import Provisioner, ProvisionerOptions
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._settings import Settings
from haru_server._steps import StepTuning
from haru_server.api import create_app
from haru_server.cli import app as cli_app
from haru_supervisor_client import SupervisorClient
from pytest_aiohttp import AiohttpClient
from typer.testing import CliRunner

TOKEN = "tok-skyserve-secret-0815"
SERVING_TOKEN = "serving-credential-for-tests-2b7d"
SERVICE = "haru-local--alpha"

FAKE_SKY = """\
#!{python}
# Fake `sky serve` (SkyPilot 0.14.1 CLI, the commands Haru uses). State in the folder baked in.
import json, os, pathlib, sys, time

state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{
    "argv": args,
    "secret": os.environ.get("HARU_SUPERVISOR_TOKEN"),
    "serving": os.environ.get("HARU_SERVING_TOKEN"),
}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")
config = json.loads((state / "config.json").read_text())

def path(name):
    return state / f"service-{{name}}.json"

def load(name):
    return json.loads(path(name).read_text()) if path(name).exists() else None

def save(name, service):
    tmp = path(name).with_suffix(".tmp")
    tmp.write_text(json.dumps(service))
    os.replace(tmp, path(name))

TITLE = "\\x1b[36m\\x1b[1m{{}}\\x1b[0m"
COLOURS = {{"READY": 32, "CONTROLLER_INIT": 34, "REPLICA_INIT": 34, "NO_REPLICA": 35,
            "SHUTTING_DOWN": 33}}

def table(header, rows, coloured):
    # sky.serve.serve_utils.format_service_table: left-aligned, two spaces after each column.
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["".join(h.ljust(w) + "  " for h, w in zip(header, widths))]
    for row in rows:
        cells = []
        for i, (cell, width) in enumerate(zip(row, widths)):
            pad = " " * (width - len(cell) + 2)
            if i == coloured:
                cell = f"\\x1b[{{COLOURS.get(cell, 31)}}m{{cell}}\\x1b[0m"
            cells.append(cell + pad)
        lines.append("".join(cells))
    return "\\n".join(lines)

if args == ["--version"]:
    print("skypilot, version 0.14.1")
elif args[:2] == ["api", "info"]:
    print(json.dumps({{"server": {{"status": "healthy", "version": "0.14.1"}}}}))
elif args[:2] == ["serve", "up"]:
    name = args[args.index("-n") + 1]
    replicas = yaml_replicas = 1
    for line in entry.get("yaml", "").splitlines():
        if line.startswith("  replicas: "):
            replicas = int(line.split(": ")[1])
    behaviour = config.get("up", {{}}).get(name, {{}})
    (state / f"up-{{name}}.pid").write_text(str(os.getpid()))
    (state / "controller").touch()
    if load(name) is not None:
        # sky/serve/service.py: the controller refuses a second service of one name.
        print(f"ValueError: Service {{name}} already exists.", file=sys.stderr)
        sys.exit(1)
    if "exit" in behaviour:
        print(behaviour["stderr"], file=sys.stderr)
        sys.exit(behaviour["exit"])
    save(name, {{"auto": True, "reads": 0, "replicas": replicas}})
    if behaviour.get("hang"):
        time.sleep(60)
    print(f"Service name: {{name}}")
    print("Endpoint URL: " + config.get("endpoint", "127.0.0.1:30001"))
elif args[:2] == ["serve", "down"]:
    # sky/serve/serve_utils.py terminate_services: `down` only schedules the termination
    # (SHUTTING_DOWN for `down_reads` more status reads); a failed service is skipped with
    # exit 0 unless --purge; no controller at all: exit 1 "No live services."
    name = args[2]
    service = load(name)
    if not (state / "controller").exists():
        print("No live services.", file=sys.stderr)
        sys.exit(1)
    if service is None:
        print("No service to terminate.")
        sys.exit(0)
    failed = service.get("status") in ("FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP")
    if failed and "--purge" not in args:
        print(f"Service {{name!r}} is in failed status. Skipping its termination.")
        sys.exit(0)
    save(name, {{"auto": False, "status": "SHUTTING_DOWN", "ready": 0, "total": 0,
                "endpoint": None, "left": config.get("down_reads", 2)}})
    print(f"Service {{name!r}} is scheduled to be terminated.")
elif args[:2] == ["serve", "status"]:
    name = args[2]
    service = load(name)
    print(TITLE.format("Services"))
    if service is None:
        print("No live services.")
        sys.exit(0)
    if service.get("left") is not None:
        if service["left"] == 0:
            path(name).unlink()
            print("No live services.")
            sys.exit(0)
        service["left"] -= 1
        save(name, service)
    if service["auto"]:
        service["reads"] += 1
        n, reads = service["replicas"], service["reads"]
        if reads < 2:
            service.update(status="CONTROLLER_INIT", ready=0, total=0, endpoint=None)
        elif reads < config.get("ready_after", 3):
            service.update(status="REPLICA_INIT", ready=0, total=n, endpoint=None)
        else:
            endpoint = config.get("endpoint", "127.0.0.1:30001")
            service.update(status="READY", ready=n, total=n, endpoint=endpoint)
        save(name, service)
    ready = service["status"] == "READY"
    row = [name, "1", "1m 5s" if ready else "-", service["status"],
           f"{{service['ready']}}/{{service['total']}}", service["endpoint"] or "-"]
    print(table(["NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT"], [row], 3))
    print()
    print(TITLE.format("Service Replicas"))
    replicas = [[name, str(i + 1), "1", "http://10.0.0.%d:8000" % (i + 1), "1 min ago",
                 "AWS (us-east-1)", "1x(gpus=L4:1)", "READY" if i < service["ready"] else
                 "STARTING"] for i in range(service["total"])]
    if replicas:
        print(table(["SERVICE_NAME", "ID", "VERSION", "ENDPOINT", "LAUNCHED", "INFRA",
                     "RESOURCES", "STATUS"], replicas, 7))
    else:
        print("No existing replicas.")
else:
    print(f"Error: No such command '{{args[0]}}'.", file=sys.stderr)
    sys.exit(2)
"""


class FakeSky:
    def __init__(self, state: Path) -> None:
        self.state = state

    def configure(self, **config: Any) -> None:
        (self.state / "config.json").write_text(json.dumps(config))

    def calls(self) -> list[dict[str, Any]]:
        path = self.state / "calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def ups(self, name: str) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["argv"][:2] == ["serve", "up"] and name in c["argv"]]

    def services(self) -> set[str]:
        return {p.stem.removeprefix("service-") for p in self.state.glob("service-*.json")}

    def set_service(self, name: str, status: str | None, *, ready: int = 0, total: int = 0) -> None:
        """Fix the service's row (None: SkyServe does not know it any more)."""
        path = self.state / f"service-{name}.json"
        if status is None:
            path.unlink(missing_ok=True)
            return
        endpoint = "127.0.0.1:30001" if status == "READY" else None
        row = {"auto": False, "status": status, "ready": ready, "total": total}
        path.write_text(json.dumps({**row, "endpoint": endpoint}))

    def up_pid(self, name: str) -> int:
        return int((self.state / f"up-{name}.pid").read_text())


@pytest.fixture
def sky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSky:
    bin_dir = tmp_path / "bin"
    state = tmp_path / "sky-state"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "sky"
    script.write_text(FAKE_SKY.format(python=sys.executable, state=str(state)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    fake = FakeSky(state)
    fake.configure()
    return fake


async def no_sleep(_delay: float) -> None:
    await asyncio.sleep(0)


@pytest.fixture
async def make_reconciler(clock: ManualClock, http: aiohttp.ClientSession) -> Any:
    made: list[Provisioner] = []

    def make(store: StateStore) -> tuple[Reconciler, Provisioner]:
        provisioner = Provisioner(
            store,
            SkyPilotDriver(SkyRunner(retry_delay=0)),
            clock=clock,
            supervisor_token=TOKEN,
            serving_token=SERVING_TOKEN,
            options=ProvisionerOptions(status_interval_s=0, preflight=False),
            service_driver=SkyServeDriver(SkyRunner(retry_delay=0), sleep=no_sleep),
        )
        made.append(provisioner)
        reconciler = Reconciler(
            store,
            SupervisorClient(http, token=None),
            clock=clock,
            options=ReconcilerOptions(
                tuning=StepTuning(settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05),
                heartbeat_timeout_s=2.0,
            ),
            provisioner=provisioner,
        )
        return reconciler, provisioner

    yield make
    for provisioner in made:
        await provisioner.close()


def skyserve_domain(replicas: int = 1) -> dict[str, Any]:
    return {
        "slug": "alpha",
        "provider": "skyserve",
        "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"},
        "provisioning": {"replicas": replicas},
        "slots": [
            {"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat-a"}, {"name": "chat-b"}]}
        ],
    }


def bare_layout(replicas: int = 1, **policy: Any) -> FleetLayout:
    """One skyserve domain, the active."""
    return FleetLayout.model_validate(
        {
            "slug": "local",
            "activeDomainSlug": "alpha",
            "domains": [skyserve_domain(replicas)],
            "policy": policy,
        }
    )


def mixed_layout(fleet: LocalFleet, **policy: Any) -> FleetLayout:
    """alpha: a skyserve active; beta: the local fleet's static standby (a real supervisor)."""
    document = fleet.layout().model_dump(mode="json", by_alias=True, exclude_none=True)
    document["domains"][0] = skyserve_domain()
    document["policy"] = {"autoFailover": True, **policy}
    return FleetLayout.model_validate(document)


async def snapshot(store: StateStore) -> FleetSnapshot:
    found = await store.get_fleet_snapshot("local")
    assert found is not None
    return found


def domain(fleet: FleetSnapshot, slug: str) -> DomainSnapshot:
    return next(d for d in fleet.domains if d.slug == slug)


async def events(store: StateStore, fleet_id: UUID, type_: str | None = None) -> list[Event]:
    found = await store.list_events(fleet_id, limit=1000)
    return [e for e in found if type_ is None or e.type == type_]


async def tick_until(
    reconciler: Reconciler,
    store: StateStore,
    done: Callable[[FleetSnapshot], bool],
    *,
    max_ticks: int = 200,
) -> FleetSnapshot:
    current = await snapshot(store)
    for _ in range(max_ticks):
        await reconciler.tick("local")
        current = await snapshot(store)
        if done(current):
            return current
        await asyncio.sleep(0.02)
    raise AssertionError(f"not done after {max_ticks} ticks: {current}")


def in_state(slug: str, state: DomainState) -> Callable[[FleetSnapshot], bool]:
    return lambda fleet: domain(fleet, slug).state is state


def slot_states(got: DomainSnapshot) -> list[InferenceSlotState]:
    return [s.state for s in got.slots]  # type: ignore[misc]


async def test_service_to_ready_on_its_ready_replicas_with_the_endpoint_as_serving_url(
    sqlite_store: StateStore,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    aiohttp_client: AiohttpClient,
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(replicas=2), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launched_at is not None)
    # READY with one of the two replicas: SkyServe already routes, Haru waits for both.
    sky.set_service(SERVICE, "READY", ready=1, total=2)
    for _ in range(3):
        await reconciler.tick("local")
    waiting = domain(await snapshot(store), "alpha")
    assert (waiting.state, waiting.serving_base_url) == (DomainState.PROVISIONING, None)
    assert routable_models(await snapshot(store)) == ()
    sky.set_service(SERVICE, "READY", ready=2, total=2)
    done = await tick_until(reconciler, store, in_state("alpha", DomainState.READY))

    alpha = domain(done, "alpha")
    assert alpha.supervisor_url is None
    assert str(alpha.serving_base_url) == "http://127.0.0.1:30001"
    assert slot_states(alpha) == [InferenceSlotState.SERVING]
    urls = {m.name: str(m.serving_url) for s in alpha.slots for m in getattr(s.spec, "models", ())}
    assert urls == {
        "chat-a": "http://127.0.0.1:30001/m/chat-a",
        "chat-b": "http://127.0.0.1:30001/m/chat-b",
    }
    # The proxy routes to the service's load balancer.
    assert [(m.name, str(m.serving_url)) for m in routable_models(done)] == list(urls.items())
    [up] = sky.ups(SERVICE)
    assert up["argv"][:7] == ["serve", "up", "-n", SERVICE, "-y", "--secret", "HARU_SERVING_TOKEN"]
    assert up["argv"][7].endswith(f"{SERVICE}.yaml")
    # No supervisor on a SkyServe replica: no supervisor token travels, only the serving
    # credential its gateway requires, through sky's environment.
    assert up["secret"] is None
    assert up["serving"] == SERVING_TOKEN
    rendered = yaml.safe_load(up["yaml"])
    probe = {"path": "/health", "initial_delay_seconds": 3600}
    assert rendered["service"] == {"readiness_probe": probe, "replicas": 2, "ports": 8000}
    assert rendered["secrets"] == {"HARU_SERVING_TOKEN": None}
    assert TOKEN not in json.dumps(sky.calls())
    assert SERVING_TOKEN not in json.dumps([c["argv"] for c in sky.calls()])
    assert SERVING_TOKEN not in up["yaml"]
    # Its slots were seeded serving (the declared active's posture): only the domain moves.
    types = [e.type for e in await events(store, done.id) if e.domain_id == alpha.id]
    assert types == [
        EventType.DOMAIN_LAUNCH_STARTED,
        EventType.DOMAIN_LAUNCH_SUCCEEDED,
        EventType.DOMAIN_ADDRESS_RECORDED,
        EventType.DOMAIN_STATE_CHANGED,
    ]
    [changed] = await events(store, done.id, EventType.DOMAIN_STATE_CHANGED)
    assert (changed.payload["from"], changed.payload["to"], changed.payload["role"]) == (
        "provisioning",
        "ready",
        "active",
    )
    [address] = await events(store, done.id, EventType.DOMAIN_ADDRESS_RECORDED)
    assert address.payload["supervisorUrl"] is None
    assert address.payload["servingBaseUrl"] == "http://127.0.0.1:30001"

    # The API: the service's status, and `down` refused for the active.
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    response = await client.get("/v1/fleets/local/domains/alpha")
    body = await response.json()
    assert (body["role"], body["clusterName"], body["clusterStatus"]) == (
        "active",
        SERVICE,
        "READY",
    )
    response = await client.post("/v1/fleets/local/domains/alpha/down")
    assert response.status == 409
    assert "active domain" in (await response.json())["error"]["message"]
    assert domain(await snapshot(store), "alpha").state is DomainState.READY
    assert not [c for c in sky.calls() if c["argv"][:2] == ["serve", "down"]]


async def test_serve_up_failure_fails_the_domain_with_the_command_in_an_event(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    sky.configure(up={SERVICE: {"exit": 1, "stderr": "ValueError: Invalid service YAML."}})
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    [event] = await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
    assert event.payload["reason"] == "launch_failed"
    assert event.payload["exitCode"] == 1
    assert "Invalid service YAML." in event.payload["stderr"]
    assert event.payload["argv"][1:5] == ["serve", "up", "-n", SERVICE]
    # A launch that never went through is not relaunched on its own.
    clock.advance(ms=failed.policy.relaunch_backoff_max_ms + 1)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    assert len(sky.ups(SERVICE)) == 1


async def test_serve_up_past_its_budget_is_killed_and_fails_the_domain(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    sky.configure(up={SERVICE: {"hang": True}})
    await store.apply_fleet_layout(bare_layout(launchTimeoutMs=60_000), at=clock())
    reconciler, provisioner = make_reconciler(store)
    await reconciler.tick("local")
    alpha = domain(await snapshot(store), "alpha")
    async with asyncio.timeout(10):
        while SERVICE not in sky.services():
            await asyncio.sleep(0.02)
    pid = sky.up_pid(SERVICE)
    await reconciler.tick("local")
    assert provisioner.launching(alpha.id)
    clock.advance(ms=60_001)
    await reconciler.tick("local")
    failed = await snapshot(store)
    assert domain(failed, "alpha").state is DomainState.FAILED
    assert not provisioner.launching(alpha.id)
    [event] = await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
    assert event.payload["reason"] == "launch_timeout"
    message = event.payload["message"]
    assert "`sky serve up` of haru-local--alpha ran past launchTimeoutMs" in message
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_restart_mid_serve_up_never_brings_the_same_attempt_up_again(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    # `sky serve up` registers the service, then the server dies before it returns.
    sky.configure(up={SERVICE: {"hang": True}})
    await store.apply_fleet_layout(bare_layout(), at=clock())
    first, first_provisioner = make_reconciler(store)
    await first.tick("local")
    async with asyncio.timeout(10):
        while SERVICE not in sky.services():
            await asyncio.sleep(0.02)
    await first_provisioner.close()
    assert domain(await snapshot(store), "alpha").launched_at is None
    second, _ = make_reconciler(store)
    done = await tick_until(second, store, in_state("alpha", DomainState.READY))
    assert len(sky.ups(SERVICE)) == 1
    alpha = domain(done, "alpha")
    assert alpha.launch_attempt == 1
    assert str(alpha.serving_base_url) == "http://127.0.0.1:30001"
    [succeeded] = await events(store, done.id, EventType.DOMAIN_LAUNCH_SUCCEEDED)
    assert succeeded.payload["observed"] is True


async def test_ready_replicas_budget(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(replicas=2, clusterUpTimeoutMs=120_000), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launched_at is not None)
    sky.set_service(SERVICE, "READY", ready=1, total=2)
    clock.advance(ms=120_001)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    [event] = await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
    assert event.payload["reason"] == "cluster_up_timeout"
    assert "READY with 2 READY replica(s)" in event.payload["message"]


@pytest.mark.parametrize("status", ["FAILED", "NO_REPLICA", "SHUTTING_DOWN", None])
async def test_a_lost_service_during_provisioning_fails_the_domain(
    sqlite_store: StateStore,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    status: str | None,
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launched_at is not None)
    sky.set_service(SERVICE, status)
    if status == "NO_REPLICA":
        # SkyServe replaces lost replicas by itself: NO_REPLICA is lost only once it lasts.
        for _ in range(3):
            await reconciler.tick("local")
        assert domain(await snapshot(store), "alpha").state is DomainState.PROVISIONING
        clock.advance(ms=120_000)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    [event] = await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
    assert event.payload["reason"] == "cluster_lost"
    assert event.payload["clusterStatus"] == (status or "absent")


async def test_lost_active_service_fails_over_relaunches_and_goes_down(
    sqlite_store: StateStore,
    make_fleet: Any,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    aiohttp_client: AiohttpClient,
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    layout = mixed_layout(fleet, relaunchBackoffBaseMs=60_000, relaunchMaxAttempts=2)
    await store.apply_fleet_layout(layout, at=clock())
    reconciler, provisioner = make_reconciler(store)
    ready = await tick_until(
        reconciler, store, lambda f: all(d.state is DomainState.READY for d in f.domains)
    )
    alpha_id, beta_id = domain(ready, "alpha").id, domain(ready, "beta").id
    assert ready.active_domain_id == alpha_id
    # Every replica preempted and none left: SkyServe reports NO_REPLICA.
    sky.set_service(SERVICE, "NO_REPLICA")
    await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.READY  # not yet
    clock.advance(ms=120_000)
    result = await reconciler.tick("local")
    after = await snapshot(store)
    alpha = domain(after, "alpha")
    assert alpha.state is DomainState.FAILED
    assert slot_states(alpha) == [InferenceSlotState.FAILED]
    [lost] = await events(store, ready.id, EventType.DOMAIN_CLUSTER_LOST)
    assert (lost.domain_id, lost.payload["clusterStatus"], lost.payload["role"]) == (
        alpha_id,
        "NO_REPLICA",
        "active",
    )
    assert result.operation is not None
    assert (result.operation.kind, result.operation.target_domain_id) == (
        OperationKind.PROMOTE,
        beta_id,
    )
    promotion = result.operation.id
    state = result.operation.state
    for _ in range(100):
        await reconciler.tick("local")
        operation = await store.get_operation(promotion)
        assert operation is not None
        state = operation.state
        if state is not OperationState.RUNNING:
            break
        await asyncio.sleep(0.02)
    assert state is OperationState.SUCCEEDED
    assert (await snapshot(store)).active_domain_id == beta_id
    # The old active is a service: nothing to put to sleep or train on, both steps skipped.
    done = [
        e.payload
        for e in await events(store, ready.id, EventType.OPERATION_STEP_DONE)
        if e.payload["step"]
        in (OperationStep.DEMOTE_OLD_SLEEP.value, OperationStep.DEMOTE_OLD_TRAIN.value)
    ]
    assert [p.get("skipped", "") for p in done] == [
        "the previous active is a skyserve domain (always awake, no supervisor)"
    ] * 2

    # Relaunch after the backoff, as a standby: the same service (replicas never sleep).
    assert len(sky.ups(SERVICE)) == 1
    clock.advance(ms=60_000)
    await reconciler.tick("local")
    relaunched = domain(await snapshot(store), "alpha")
    assert (relaunched.state, relaunched.launch_attempt) == (DomainState.PROVISIONING, 2)
    [relaunch] = await events(store, ready.id, EventType.DOMAIN_RELAUNCH)
    assert (relaunch.payload["relaunch"], relaunch.payload["maxAttempts"]) == (1, 2)
    back = await tick_until(reconciler, store, in_state("alpha", DomainState.READY))
    assert slot_states(domain(back, "alpha")) == [InferenceSlotState.SERVING]
    moves = [
        (e.payload["from"], e.payload["to"], e.payload["cause"])
        for e in await events(store, ready.id, EventType.SLOT_STATE_CHANGED)
        if e.domain_id == alpha_id
    ]
    assert moves == [("serving", "failed", "service"), ("failed", "serving", "service")]
    assert back.active_domain_id == beta_id
    ups = sky.ups(SERVICE)
    assert len(ups) == 2
    assert ups[0]["yaml"] == ups[1]["yaml"]
    started = [
        (e.payload["attempt"], e.payload["role"])
        for e in await events(store, ready.id, EventType.DOMAIN_LAUNCH_STARTED)
        if e.domain_id == alpha_id
    ]
    assert started == [(1, "active"), (2, "standby")]
    await provisioner.close()

    # `haru domain down` of the (now standby) service: `sky serve down`, then stopped.
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    response = await client.post("/v1/fleets/local/domains/alpha/down")
    assert response.status == 202
    # (`serve down` is asynchronous: the driver reads `serve status` every DOWN_POLL_S.)
    for _ in range(1500):
        await client.post("/v1/fleets/local/reconcile")
        if domain(await snapshot(store), "alpha").state is DomainState.STOPPED:
            break
        await asyncio.sleep(0.02)
    assert domain(await snapshot(store), "alpha").state is DomainState.STOPPED
    # The relaunch took the lost service down first (SkyServe refuses a second `serve up`
    # of a listed name), then `haru domain down`; each waited until it was no longer listed.
    assert [c["argv"] for c in sky.calls() if c["argv"][:2] == ["serve", "down"]] == [
        ["serve", "down", SERVICE, "-y", "--purge"]
    ] * 2
    assert SERVICE not in sky.services()
    body = await (await client.get("/v1/fleets/local/domains/alpha")).json()
    assert body["clusterStatus"] == "absent"
    assert [e["type"] for e in body["events"]][-1] == "domain.teardown"


def test_seed_refuses_what_a_skyserve_domain_cannot_do(tmp_path: Path) -> None:
    """``haru seed`` refuses, before touching the store, a layout asking SkyServe for promotion
    parts it cannot give: a standby (sleep, train, wake and probe), training, missing GPUs,
    a supervisor."""
    database = tmp_path / "haru.db"
    url = f"sqlite:///{database}"
    standby = {
        "slug": "beta",
        "provider": "skypilot",
        "placement": {"cloud": "aws", "region": "us-west-2", "accelerator": "L4"},
        "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat-c"}]}],
    }
    training = {"kind": "training", "gpuIndex": 0, "command": ["t"], "checkpointDir": "/c"}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"activeDomainSlug": "beta", "domains": [skyserve_domain(), standby]},
            "<root>: Value error, skyserve domain(s) ['alpha'] would be standbys",
        ),
        (
            {
                "activeDomainSlug": "alpha",
                "domains": [
                    {**skyserve_domain(), "slots": [*skyserve_domain()["slots"], training]},
                    standby,
                ],
            },
            "a SkyServe service cannot train",
        ),
        (
            {
                "activeDomainSlug": "alpha",
                "domains": [
                    {
                        **skyserve_domain(),
                        "slots": [{"kind": "inference", "gpuIndex": 1, "models": [{"name": "x"}]}],
                    }
                ],
            },
            "gpuIndex [1] does not exist on a replica with acceleratorCount 1",
        ),
        (
            {
                "activeDomainSlug": "alpha",
                "domains": [{**skyserve_domain(), "provisioning": {"supervisorPort": 8701}}],
            },
            "supervisorPort asks for a Haru supervisor",
        ),
    ]
    path = tmp_path / "layout.json"
    for document, message in cases:
        path.write_text(json.dumps({"slug": "local", **document}))
        result = CliRunner().invoke(cli_app, ["seed", str(path), "--database-url", url])
        assert result.exit_code == 2, result.output
        shown = " ".join(result.output.split())
        assert "is not a valid fleet layout" in shown
        assert message in shown, result.output
    assert not database.exists()
    # The same fleet with the skyserve domain active seeds.
    path.write_text(
        json.dumps({"slug": "local", "activeDomainSlug": "alpha", "domains": [skyserve_domain()]})
    )
    result = CliRunner().invoke(cli_app, ["seed", str(path), "--database-url", url])
    assert result.exit_code == 0, result.output
