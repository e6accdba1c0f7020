"""The lifecycle of ``skypilot`` domains in the reconcile tick, against a fake ``sky``.

The fake ``sky`` is a real executable on a temp PATH, run through the real driver and runner:
it records each argv, answers ``status NAME -o json`` like SkyPilot 0.14 (``[]`` after a
``Cluster(s) not found`` line for an unknown cluster; INIT until the Nth read, then UP,
with ``up_together`` only in a read that names every member of the group not yet UP;
STOPPED once preempted), ``status --ip NAME`` with 127.0.0.1, and fails or hangs a launch
on request. Where heartbeats matter, the "cluster" is a local fleet: real supervisors on
127.0.0.1 whose ports the layout names as ``supervisorPort``. Budgets run on the injected
clock; the store is real.

Where SkyPilot 0.14.1 is unkind, the fake is too (read from its source):

- ``launch`` with ``late``: killing the client does not cancel the launch. ``sky launch``
  only submits a request to the API server and waits on it; on a kill the client says
  "Request will continue running asynchronously" (``sky/client/cli/command.py``, the
  launch's request wait) and the server's request brings the cluster up later. Here a
  detached process outlives the killed client and then lists the cluster UP.
- ``launch`` with ``exit`` and ``leave``: a launch that fails after provisioning (a setup
  failure) exits non-zero and leaves the cluster listed (UP, kept "for debugging":
  ``sky/backends/cloud_vm_ray_backend.py``, setup and provisioning failure handling).
- ``launch`` with ``exit`` (a ``ResourcesUnavailableError`` stderr): the capacity or quota
  error a relaunch meets right after a spot preemption (``sky/exceptions.py``).
- ``status --ip``: exit 1 with ``ValueError ... not found`` for an unknown cluster and
  ``... is not in UP status`` for one that is not UP (``sky/client/cli/command.py``
  ``status`` with ``--ip``).
- INIT that never turns UP (``up_after`` large): INIT is also SkyPilot's abnormal state
  (``sky/utils/status_lib.py`` ``ClusterStatus.INIT``: setup failed, or a node unhealthy).
- ``launch`` onto a cluster still listed: SkyPilot reuses it, re-runs setup and queues the
  new job behind the old one, which holds every GPU, so the new job stays PENDING
  (``sky/execution.py``, the cluster's job queue); the fake keeps the cluster and appends a
  PENDING job (``FakeSky.jobs``).
- ``status --endpoint PORT N``: the port's endpoint, which need not be the head's IP with
  PORT (``port_offset`` maps it as RunPod, Vast or a Kubernetes LoadBalancer would;
  ``sky/client/cli/command.py`` ``_show_endpoint``); exit 1 when unknown or not UP.
- ``status N1 N2 ... [--refresh] -o json``: one call for many clusters; a preemption
  (``FakeSky.preempt``) shows only after a refresh, forced by ``--refresh`` or the API
  server's daemon every 60 s (``sky/server/server.py``, ``sky/backends/backend_utils.py``).
- ``--version`` and ``api info -o json`` answer what ``config.version`` says (Haru's
  preflight refuses a ``sky`` older than 0.12).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import aiohttp
import pytest
import trustme
from haru_core import lease_guard_ms
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_driver_skypilot import TOKEN_SECRET, SkyPilotDriver, SkyRunner
from haru_protocol import (
    DomainLaunchStarted,
    DomainSnapshot,
    DomainState,
    DomainUpRequested,
    Event,
    EventType,
    FleetLayout,
    FleetSnapshot,
    OperationKind,
    OperationState,
    OperationStep,
    RoutingSwitched,
)
from haru_server._clock import ManualClock
from haru_server._pki import FleetPki, StoreKey
from haru_server._provisioning import Provisioner, ProvisionerOptions
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._settings import Settings
from haru_server._steps import StepTuning
from haru_server.api import create_app
from haru_server.cli import app as cli_app
from haru_supervisor_client import SupervisorClient, SupervisorLinks
from pytest_aiohttp import AiohttpClient
from typer.testing import CliRunner

MakeFleet = Callable[..., Awaitable[LocalFleet]]
TOKEN = "tok-provisioning-secret-4711"
SERVING_TOKEN = "serving-credential-for-tests-2b7d"

FAKE_SKY = """\
#!{python}
# Fake `sky` (SkyPilot 0.14 CLI, the commands Haru uses). State in the folder baked in.
import json, os, pathlib, subprocess, sys, time

state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{"argv": args, "secret": os.environ.get("HARU_SUPERVISOR_TOKEN")}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")
config = json.loads((state / "config.json").read_text())
LATE = '''
import json, os, pathlib, sys, time
client, cluster, marker = int(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
for _ in range(1500):
    try:
        os.kill(client, 0)
    except ProcessLookupError:
        break
    time.sleep(0.02)
cluster.write_text(json.dumps({{"status": "UP", "reads": 0}}))
marker.write_text("up")
'''
# One file per cluster: concurrent launches of two clusters never lose each other's write.
def path(name):
    return state / f"cluster-{{name}}.json"

def load(name):
    return json.loads(path(name).read_text()) if path(name).exists() else None

def save(name, cluster):
    tmp = path(name).with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster))
    os.replace(tmp, path(name))

if args == ["--version"]:
    print("skypilot, version " + config.get("version", "0.14.1"))
elif args[:2] == ["api", "info"]:
    print(json.dumps({{"client": {{"version": "0.14.1"}}, "server": {{"status": "healthy",
          "version": config.get("version", "0.14.1"), "url": "http://127.0.0.1:46580"}}}}))
elif args[:1] == ["launch"]:
    name = args[args.index("-c") + 1]
    behaviour = config.get("launch", {{}}).get(name, {{}})
    (state / f"launch-{{name}}.pid").write_text(str(os.getpid()))
    if behaviour.get("late"):
        # The API server's request: outlives this client, then lists the cluster UP.
        subprocess.Popen(
            [sys.executable, "-c", LATE, str(os.getpid()), str(path(name)),
             str(state / f"appeared-{{name}}")],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(60)
    if "exit" in behaviour:
        if behaviour.get("leave"):
            save(name, {{"status": behaviour["leave"], "reads": 0}})
        print("Considered resources (1 node):")
        print(behaviour["stderr"], file=sys.stderr)
        sys.exit(behaviour["exit"])
    cluster = load(name)
    if cluster is not None:
        # SkyPilot reuses the cluster, re-runs setup and queues the job behind the old one,
        # which holds every GPU: the new job stays PENDING.
        cluster.setdefault("jobs", ["RUNNING"]).append("PENDING")
        save(name, cluster)
        print(f"Job submitted, ID: {{len(cluster['jobs'])}}")
        sys.exit(0)
    save(name, {{"status": "INIT", "reads": 0, "jobs": ["RUNNING"], "refreshed": time.time()}})
    if behaviour.get("hang"):
        time.sleep(60)
    time.sleep(behaviour.get("delay", 0))
    print("Job submitted, ID: 1")
elif args[:1] == ["down"]:
    path(args[1]).unlink(missing_ok=True)
elif args[:1] == ["status"] and "--endpoint" in args:
    port = int(args[args.index("--endpoint") + 1])
    name = args[-1]
    cluster = load(name)
    if cluster is None:
        print(f"ValueError: Cluster {{name!r}} not found.", file=sys.stderr)
        sys.exit(1)
    if cluster["status"] != "UP":
        print(f"RuntimeError: Cluster {{name!r}} is not in UP status.", file=sys.stderr)
        sys.exit(1)
    print(f"127.0.0.1:{{port + config.get('port_offset', 0)}}")
elif args[:1] == ["status"] and "--ip" in args:
    name = args[-1]
    cluster = load(name)
    if cluster is None:
        print(f"ValueError: Cluster {{name!r}} not found.", file=sys.stderr)
        sys.exit(1)
    if cluster["status"] != "UP":
        print(f"ValueError: Cluster {{name!r}} is not in UP status.", file=sys.stderr)
        sys.exit(1)
    print("127.0.0.1")
elif args[:1] == ["status"]:
    names = [a for a in args[1:] if not a.startswith("-") and a != "json"]
    rows = []
    for name in names:
        cluster = load(name)
        if cluster is not None and "cloud" in cluster and (
            "--refresh" in args or time.time() - cluster.get("refreshed", 0) >= 60
        ):
            # Only a refresh (forced, or the daemon's every 60 s) sees what the cloud did.
            if cluster["cloud"] == "gone":
                path(name).unlink()
                continue
            cluster["status"] = cluster.pop("cloud")
            save(name, cluster)
        if cluster is None:
            continue
        if cluster["status"] == "INIT":
            cluster["reads"] += 1
            together = config.get("up_together", [])
            # The group comes up in a read naming every member not yet UP: the first
            # member needs a read naming them all, the last may be read alone.
            if cluster["reads"] >= config.get("up_after", 2) and all(
                n in names or (load(n) or {{}}).get("status") == "UP"
                for n in (together if name in together else [])
            ):
                cluster["status"] = "UP"
            save(name, cluster)
        rows.append({{"name": name, "status": cluster["status"], "nodes": 1, "autostop": -1,
                     "launched_at": 1764460800}})
    missing = [n for n in names if n not in [r["name"] for r in rows]]
    if missing:
        print(f"Cluster(s) not found: \\x1b[1m{{', '.join(missing)}}\\x1b[0m.")
    print(json.dumps(rows, indent=2))
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

    def launches(self, name: str) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["argv"][:1] == ["launch"] and name in c["argv"]]

    def clusters(self) -> dict[str, Any]:
        return {
            p.name.removeprefix("cluster-").removesuffix(".json"): json.loads(p.read_text())
            for p in self.state.glob("cluster-*.json")
        }

    def set_status(self, name: str, status: str | None) -> None:
        path = self.state / f"cluster-{name}.json"
        if status is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps({"status": status, "reads": 0}))

    def preempt(self, name: str, to: str = "gone") -> None:
        """What the cloud did; SkyPilot's cache shows it only after a refresh."""
        path = self.state / f"cluster-{name}.json"
        cluster = json.loads(path.read_text())
        cluster["cloud"] = to
        path.write_text(json.dumps(cluster))

    def jobs(self, name: str) -> list[str]:
        return list(self.clusters()[name].get("jobs", []))

    def downs(self, name: str) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["argv"][:2] == ["down", name]]

    def appeared(self, name: str) -> bool:
        return (self.state / f"appeared-{name}").exists()

    def launch_pid(self, name: str) -> int:
        return int((self.state / f"launch-{name}.pid").read_text())


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


@pytest.fixture
async def make_reconciler(clock: ManualClock, http: aiohttp.ClientSession) -> Any:
    made: list[Provisioner] = []

    def make(
        store: StateStore, *, store_key: StoreKey | None = STORE_KEY
    ) -> tuple[Reconciler, Provisioner]:
        provisioner = Provisioner(
            store,
            SkyPilotDriver(SkyRunner(retry_delay=0)),
            clock=clock,
            supervisor_token=TOKEN,
            serving_token=SERVING_TOKEN,
            options=ProvisionerOptions(status_interval_s=0, preflight=False),
            pki=FleetPki(store, store_key),
        )
        made.append(provisioner)
        links = SupervisorLinks(issued=provisioner_pki(provisioner).trusts)
        reconciler = Reconciler(
            store,
            SupervisorClient(http, token=None, links=links),
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


STORE_KEY = StoreKey(StoreKey.generate().encode())
FLEET_CA = trustme.CA()
"""Stands in for the fleet's CA: the local supervisors serve a certificate it issued."""


def provisioner_pki(provisioner: Provisioner) -> FleetPki:
    pki = provisioner._pki
    assert pki is not None
    return pki


@pytest.fixture
def supervisor_tls(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for both domains' names, from :data:`FLEET_CA` (the local supervisors')."""
    leaf = FLEET_CA.issue_cert("alpha.local.haru.internal", "beta.local.haru.internal")
    cert, key = tmp_path / "supervisor.crt", tmp_path / "supervisor.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


async def adopt_fleet_ca(store: StateStore, clock: ManualClock) -> None:
    """Store :data:`FLEET_CA` as the fleet's CA, its key sealed, before the first launch."""
    fleet = await snapshot(store)
    await store.create_fleet_ca(
        fleet.id,
        cert_pem=FLEET_CA.cert_pem.bytes().decode(),
        sealed_key=STORE_KEY.seal(FLEET_CA.private_key_pem.bytes()),
        at=clock(),
    )


def provisioned_layout(fleet: LocalFleet, **policy: Any) -> FleetLayout:
    """The local fleet's layout with every domain a ``skypilot`` one, no URL typed in.

    Each domain's ``supervisorPort`` is its local supervisor's, so the address the fake
    ``sky status --ip`` reports (127.0.0.1) leads the heartbeat to it.
    """
    document = fleet.layout().model_dump(mode="json", by_alias=True, exclude_none=True)
    for domain in document["domains"]:
        port = urlsplit(fleet.domain(domain["slug"]).supervisor_url).port
        domain["provider"] = "skypilot"
        domain.pop("supervisorUrl", None)
        domain.pop("servingBaseUrl", None)
        domain["provisioning"] = {"supervisorPort": port, "gatewayPort": 8000}
        for slot in domain["slots"]:
            for model in slot.get("models", ()):
                model.pop("servingUrl", None)
    document["policy"] = {"autoFailover": True, **policy}
    return FleetLayout.model_validate(document)


def bare_layout(**policy: Any) -> FleetLayout:
    """Two ``skypilot`` domains and nothing running behind them."""
    domains = [
        {
            "slug": slug,
            "provider": "skypilot",
            "placement": {"cloud": "gcp", "region": "us-central1", "accelerator": "L4"},
            "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": f"{slug}-m"}]}],
        }
        for slug in ("alpha", "beta")
    ]
    return FleetLayout.model_validate(
        {"slug": "local", "activeDomainSlug": "alpha", "domains": domains, "policy": policy}
    )


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
    """Tick (yielding to the background launches between ticks) until ``done``."""
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


async def test_layout_to_ready_with_no_hand_typed_url(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    supervisor_tls: tuple[Path, Path],
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=(), supervisor_tls=supervisor_tls)
    layout = provisioned_layout(fleet)
    await store.apply_fleet_layout(layout, at=clock())
    await adopt_fleet_ca(store, clock)
    reconciler, _ = make_reconciler(store)
    seeded = await snapshot(store)
    assert all(d.supervisor_url is None for d in seeded.domains)

    def ready(fleet_: FleetSnapshot) -> bool:
        return all(d.state is DomainState.READY for d in fleet_.domains)

    done = await tick_until(reconciler, store, ready)
    for slug in ("alpha", "beta"):
        got = domain(done, slug)
        assert str(got.supervisor_url) == fleet.domain(slug).supervisor_url
        assert str(got.serving_base_url) == "https://127.0.0.1:8000"
        assert got.launch_attempt == 1
        assert got.launched_at is not None
        urls = [str(m.serving_url) for s in got.slots for m in getattr(s.spec, "models", ())]
        assert urls
        assert all(u.startswith("https://127.0.0.1:8000/m/") for u in urls)
        launches = sky.launches(f"haru-local--{slug}")
        assert len(launches) == 1
        argv = launches[0]["argv"]
        assert argv[:5] == ["launch", "-c", f"haru-local--{slug}", "-y", "-d"]
        assert argv[5:7] == ["--secret", TOKEN_SECRET]
        # The token reaches `sky` through its environment only.
        assert launches[0]["secret"] == TOKEN
        assert TOKEN not in json.dumps(argv)
        assert TOKEN not in launches[0]["yaml"]
    types = [e.type for e in await events(store, done.id) if e.domain_id == domain(done, "beta").id]
    assert types[:3] == [
        EventType.DOMAIN_LAUNCH_STARTED,
        EventType.DOMAIN_LAUNCH_SUCCEEDED,
        EventType.DOMAIN_ADDRESS_RECORDED,
    ]
    assert EventType.DOMAIN_STATE_CHANGED in types
    started = await events(store, done.id, EventType.DOMAIN_LAUNCH_STARTED)
    roles = {e.domain_id: e.payload["role"] for e in started}
    assert roles == {domain(done, "alpha").id: "active", domain(done, "beta").id: "standby"}
    assert TOKEN not in json.dumps([e.payload for e in await events(store, done.id)])


async def test_launch_failure_fails_the_domain_with_the_command_in_an_event(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    sky.configure(
        launch={"haru-local--alpha": {"exit": 3, "stderr": "No launchable resource found."}}
    )
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    [event] = [
        e
        for e in await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
        if e.domain_id == domain(failed, "alpha").id
    ]
    assert event.payload["reason"] == "launch_failed"
    assert event.payload["exitCode"] == 3
    assert "No launchable resource found." in event.payload["stderr"]
    assert event.payload["argv"][1:4] == ["launch", "-c", "haru-local--alpha"]
    assert event.payload["attempt"] == 1
    # A launch that never went through is not relaunched on its own.
    clock.advance(ms=failed.policy.relaunch_backoff_max_ms + 1)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    assert len(sky.launches("haru-local--alpha")) == 1


@pytest.mark.parametrize("store_key", ["missing", "another"])
async def test_no_launch_without_the_store_key_that_opens_the_fleet_ca(
    sqlite_store: StateStore,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    store_key: str,
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    if store_key == "another":
        await adopt_fleet_ca(store, clock)  # sealed with STORE_KEY
    key = None if store_key == "missing" else StoreKey(StoreKey.generate().encode())
    reconciler, _ = make_reconciler(store, store_key=key)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    [event] = [
        e
        for e in await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
        if e.domain_id == domain(failed, "alpha").id
    ]
    assert event.payload["reason"] == "launch_failed"
    assert "HARU_STORE_KEY_FILE" in event.payload["message"]
    expected = "no store key" if store_key == "missing" else "does not open"
    assert expected in event.payload["message"]
    assert sky.launches("haru-local--alpha") == []
    assert await store.list_domain_certs(failed.id) == []


async def test_each_launch_gets_a_fresh_certificate_only_through_secrets(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: len(sky.launches("haru-local--alpha")) == 1)
    fleet = await snapshot(store)
    stored = await store.get_fleet_ca(fleet.id)
    assert stored is not None
    assert "PRIVATE KEY" not in stored.sealed_key
    assert b"PRIVATE KEY" in STORE_KEY.open(stored.sealed_key)
    certs = {c.domain_id: c for c in await store.list_domain_certs(fleet.id)}
    cert = certs[domain(fleet, "alpha").id]
    assert cert.server_name == "alpha.local.haru.internal"
    assert cert.attempt == 1
    assert cert.not_after - cert.issued_at == timedelta(days=30)
    [launch] = sky.launches("haru-local--alpha")
    # Declared as secrets; the values reach `sky` only through its environment.
    assert launch["argv"].count("--secret") == 4  # supervisor and serving tokens, key, certificate
    assert "HARU_NODE_TLS_KEY" in launch["argv"]
    assert "HARU_NODE_TLS_KEY" in launch["yaml"]
    assert "PRIVATE KEY" not in launch["yaml"]
    assert "PRIVATE KEY" not in json.dumps(launch["argv"])


async def test_launch_past_its_budget_is_killed_and_fails_the_domain(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    sky.configure(launch={"haru-local--alpha": {"hang": True}})
    await store.apply_fleet_layout(bare_layout(launchTimeoutMs=60_000), at=clock())
    reconciler, provisioner = make_reconciler(store)
    await reconciler.tick("local")
    fleet = await snapshot(store)
    alpha = domain(fleet, "alpha")
    async with asyncio.timeout(10):
        while "haru-local--alpha" not in sky.clusters():
            await asyncio.sleep(0.02)
    pid = sky.launch_pid("haru-local--alpha")
    await reconciler.tick("local")
    assert provisioner.launching(alpha.id)
    assert domain(await snapshot(store), "alpha").state is DomainState.PROVISIONING
    clock.advance(ms=60_001)
    await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    assert not provisioner.launching(alpha.id)
    [event] = [
        e
        for e in await events(store, fleet.id, EventType.DOMAIN_PROVISIONING_FAILED)
        if e.domain_id == alpha.id
    ]
    assert event.payload["reason"] == "launch_timeout"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_restart_mid_launch_never_launches_the_same_attempt_again(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    # The launch creates the cluster, then the server dies before `sky launch` returns.
    sky.configure(launch={"haru-local--alpha": {"hang": True}}, up_after=3)
    await store.apply_fleet_layout(bare_layout(), at=clock())
    first, first_provisioner = make_reconciler(store)
    await first.tick("local")
    async with asyncio.timeout(10):
        while "haru-local--alpha" not in sky.clusters():
            await asyncio.sleep(0.02)
    await first_provisioner.close()  # the crash: the launch's process group dies with it
    fleet = await snapshot(store)
    assert domain(fleet, "alpha").launch_attempt == 1
    assert domain(fleet, "alpha").launched_at is None
    second, _ = make_reconciler(store)
    done = await tick_until(second, store, lambda f: domain(f, "alpha").supervisor_url is not None)
    assert len(sky.launches("haru-local--alpha")) == 1
    alpha = domain(done, "alpha")
    assert alpha.launch_attempt == 1
    assert str(alpha.supervisor_url) == "https://127.0.0.1:8701"
    succeeded = [
        e
        for e in await events(store, done.id, EventType.DOMAIN_LAUNCH_SUCCEEDED)
        if e.domain_id == alpha.id
    ]
    assert [e.payload["observed"] for e in succeeded] == [True]


async def test_claim_without_outcome_and_no_cluster_fails_after_the_launch_budget(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(launchTimeoutMs=60_000), at=clock())
    fleet = await snapshot(store)
    alpha = domain(fleet, "alpha")
    # A process claimed the launch and died before `sky` ever ran.
    assert await store.claim_launch(alpha.id, expected_attempt=0, at=clock())
    reconciler, _ = make_reconciler(store)
    await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.PROVISIONING
    clock.advance(ms=60_001)
    await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    assert sky.launches("haru-local--alpha") == []
    [event] = [
        e
        for e in await events(store, fleet.id, EventType.DOMAIN_PROVISIONING_FAILED)
        if e.domain_id == alpha.id
    ]
    assert event.payload["reason"] == "launch_lost"
    assert event.payload["clusterStatus"] == "absent"


async def test_cluster_up_budget(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    sky.configure(up_after=10_000)
    await store.apply_fleet_layout(bare_layout(clusterUpTimeoutMs=120_000), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launched_at is not None)
    clock.advance(ms=120_001)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    reasons = [
        e.payload["reason"]
        for e in await events(store, failed.id, EventType.DOMAIN_PROVISIONING_FAILED)
    ]
    assert "cluster_up_timeout" in reasons
    # The INIT cluster it waited for bills all the same: it is torn down.
    await tick_until(reconciler, store, lambda _: "haru-local--alpha" not in sky.clusters())
    assert sky.downs("haru-local--alpha")


async def teardowns(store: StateStore, fleet_id: UUID) -> list[dict[str, Any]]:
    return [e.payload for e in await events(store, fleet_id, EventType.DOMAIN_TEARDOWN)]


async def torn_down(
    reconciler: Reconciler, store: StateStore, fleet_id: UUID, name: str
) -> dict[str, Any]:
    """Tick until a ``domain.teardown`` event says ``name`` was torn down; return it."""
    for _ in range(100):
        for payload in await teardowns(store, fleet_id):
            if payload["ok"] and payload["cluster"] == name:
                return payload
        await reconciler.tick("local")
        await asyncio.sleep(0.02)
    raise AssertionError(f"no domain.teardown event for {name}")


async def test_a_killed_launch_that_brings_its_cluster_up_later_is_torn_down(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    name = "haru-local--alpha"
    sky.configure(launch={name: {"late": True}})
    await store.apply_fleet_layout(bare_layout(launchTimeoutMs=60_000), at=clock())
    reconciler, _ = make_reconciler(store)
    await reconciler.tick("local")
    async with asyncio.timeout(10):
        while not (sky.state / f"launch-{name}.pid").exists():
            await asyncio.sleep(0.02)
    clock.advance(ms=60_001)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    # The client is dead; its request is not: the cluster comes up after the failure.
    await tick_until(
        reconciler,
        store,
        lambda _: sky.appeared(name) and name not in sky.clusters(),
        max_ticks=1500,
    )
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    assert len(sky.launches(name)) == 1
    await torn_down(reconciler, store, failed.id, name)
    assert name not in sky.clusters()


async def test_a_setup_failure_leaves_no_cluster_up(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    name = "haru-local--alpha"
    sky.configure(
        launch={name: {"exit": 1, "stderr": "Failed to run setup command.", "leave": "UP"}}
    )
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    failed = await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    await tick_until(reconciler, store, lambda _: name not in sky.clusters())
    assert len(sky.downs(name)) >= 1
    done = await torn_down(reconciler, store, failed.id, name)
    assert "launch_failed" in done["message"]


async def test_a_relaunch_that_meets_a_capacity_error_backs_off_and_tries_again(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    name = "haru-local--alpha"
    await store.apply_fleet_layout(
        bare_layout(relaunchBackoffBaseMs=1_000, relaunchMaxAttempts=3), at=clock()
    )
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").supervisor_url is not None)
    sky.set_status(name, None)  # preempted
    await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    sky.configure(
        launch={
            name: {
                "exit": 1,
                "stderr": "sky.exceptions.ResourcesUnavailableError: Failed to provision "
                "all possible launchable resources. Relax the task's resource requirements.",
            }
        }
    )
    clock.advance(ms=1_000)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launch_attempt == 2)
    await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    sky.configure()  # capacity is back
    # Still in the streak: relaunch 2, after the doubled backoff, not the end of it.
    clock.advance(ms=1_999)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").launch_attempt == 2
    clock.advance(ms=1)
    done = await tick_until(
        reconciler,
        store,
        lambda f: (
            domain(f, "alpha").launch_attempt == 3 and domain(f, "alpha").launched_at is not None
        ),
    )
    relaunches = await events(store, done.id, EventType.DOMAIN_RELAUNCH)
    assert [(e.payload["relaunch"], e.payload["backoffMs"]) for e in relaunches] == [
        (1, 1_000),
        (2, 2_000),
    ]
    assert len(sky.launches(name)) == 3


async def test_a_failed_domain_whose_cluster_stays_init_is_torn_down_and_relaunched(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    name = "haru-local--alpha"
    await store.apply_fleet_layout(
        bare_layout(relaunchBackoffBaseMs=1_000, clusterUpTimeoutMs=120_000), at=clock()
    )
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").supervisor_url is not None)
    sky.set_status(name, "STOPPED")
    await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    # The cluster comes back INIT and stays there (an unhealthy node, not a launch).
    sky.configure(up_after=10_000)
    sky.set_status(name, "INIT")
    clock.advance(ms=1_000)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").launch_attempt == 1  # INIT: not lost yet
    clock.advance(ms=120_000)
    done = await tick_until(reconciler, store, lambda f: domain(f, "alpha").launch_attempt == 2)
    assert sky.downs(name)
    assert any("INIT" in (t.get("message") or "") for t in await teardowns(store, done.id))


async def test_up_from_failed_never_launches_onto_the_cluster_still_there(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    name = "haru-local--alpha"
    await store.apply_fleet_layout(bare_layout(), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").supervisor_url is not None)
    fleet = await snapshot(store)
    alpha = domain(fleet, "alpha")
    assert sky.clusters()[name]["status"] in {"INIT", "UP"}
    # Failed with its cluster still listed, then `haru domain up`.
    clock.advance(ms=1_000)
    assert await store.transition_domain(
        alpha.id, from_states=(alpha.state,), to=DomainState.FAILED, at=clock()
    )
    assert await store.transition_domain(
        alpha.id, from_states=(DomainState.FAILED,), to=DomainState.PROVISIONING, at=clock()
    )
    await store.append_event(
        fleet_id=fleet.id,
        payload=DomainUpRequested(from_state=DomainState.FAILED),
        at=clock(),
        domain_id=alpha.id,
    )
    await tick_until(reconciler, store, lambda _: len(sky.launches(name)) == 2)
    order = [c["argv"][0] for c in sky.calls() if name in c["argv"]]
    second = len(order) - 1 - order[::-1].index("launch")
    first = order.index("launch")
    # SkyPilot would reuse the cluster and queue the new job behind the old one.
    assert "down" in order[first + 1 : second]
    await tick_until(reconciler, store, lambda _: name in sky.clusters())
    assert sky.jobs(name) == ["RUNNING"]  # a fresh cluster, no job PENDING behind another


async def test_a_domain_launched_under_its_old_name_is_still_found_and_torn_down(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    old = "haru-local-alpha"  # the name before it was unique
    await store.apply_fleet_layout(bare_layout(), at=clock())
    fleet = await snapshot(store)
    alpha = domain(fleet, "alpha")
    assert await store.claim_launch(alpha.id, expected_attempt=0, at=clock())
    await store.append_event(
        fleet_id=fleet.id,
        payload=DomainLaunchStarted(cluster=old, attempt=1, role="active"),
        at=clock(),
        domain_id=alpha.id,
    )
    assert await store.mark_launched(alpha.id, attempt=1, at=clock())
    sky.set_status(old, "UP")
    driver = SkyPilotDriver(SkyRunner(retry_delay=0))
    provisioner = Provisioner(
        store,
        driver,
        clock=clock,
        supervisor_token=TOKEN,
        serving_token=SERVING_TOKEN,
        options=ProvisionerOptions(status_interval_s=0, preflight=False),
        pki=FleetPki(store, STORE_KEY),
    )
    try:
        current = await snapshot(store)
        assert await provisioner.cluster_name(current, domain(current, "alpha")) == old
        assert (await provisioner.read_status(current, domain(current, "alpha"))).shown == "UP"
        # Addressed under its old name, never relaunched under the new one.
        for _ in range(200):
            await provisioner.provision_round(await snapshot(store), None)
            if domain(await snapshot(store), "alpha").serving_base_url is not None:
                break
            await asyncio.sleep(0.02)
        assert domain(await snapshot(store), "alpha").serving_base_url is not None
        assert await store.transition_domain(
            alpha.id,
            from_states=(DomainState.PROVISIONING,),
            to=DomainState.STOPPING,
            at=clock(),
        )
        for _ in range(100):
            await provisioner.provision_round(await snapshot(store), None)
            if domain(await snapshot(store), "alpha").state is DomainState.STOPPED:
                break
            await asyncio.sleep(0.02)
        assert domain(await snapshot(store), "alpha").state is DomainState.STOPPED
    finally:
        await provisioner.close()
    assert sky.downs(old)
    assert old not in sky.clusters()
    assert sky.launches("haru-local--alpha") == []


async def test_preempted_active_fails_over_then_relaunches_as_standby(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    make_reconciler: Any,
    clock: ManualClock,
    sky: FakeSky,
    supervisor_tls: tuple[Path, Path],
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=(), supervisor_tls=supervisor_tls)
    await store.apply_fleet_layout(
        provisioned_layout(fleet, relaunchBackoffBaseMs=60_000, relaunchMaxAttempts=1),
        at=clock(),
    )
    await adopt_fleet_ca(store, clock)
    reconciler, _ = make_reconciler(store)
    ready = await tick_until(
        reconciler, store, lambda f: all(d.state is DomainState.READY for d in f.domains)
    )
    alpha_id = domain(ready, "alpha").id
    beta_id = domain(ready, "beta").id
    # Spot preemption: the cloud stopped the cluster, its supervisor is gone. SkyPilot's
    # cache says so only after a refresh: Haru's reads ask for one.
    sky.preempt("haru-local--alpha", "STOPPED")
    await fleet.stop_supervisor("alpha")
    result = await reconciler.tick("local")
    for _ in range(200):
        if result.operation is not None:
            break
        await asyncio.sleep(0.02)
        result = await reconciler.tick("local")
    after = await snapshot(store)
    assert domain(after, "alpha").state is DomainState.FAILED
    [lost] = await events(store, ready.id, EventType.DOMAIN_CLUSTER_LOST)
    assert lost.domain_id == alpha_id
    assert (lost.payload["clusterStatus"], lost.payload["role"]) == ("STOPPED", "active")
    assert result.operation is not None
    assert result.operation.kind is OperationKind.PROMOTE
    assert result.operation.target_domain_id == beta_id
    # The promotion runs to its end (the unreachable old active's sleep is best effort).
    for _ in range(100):
        result = await reconciler.tick("local")
        if result.operation is not None and result.operation.state is OperationState.SUCCEEDED:
            break
        clock.advance(ms=1_000)
        await asyncio.sleep(0.02)
    assert (await snapshot(store)).active_domain_id == beta_id
    # No relaunch before the backoff since the failure has passed.
    assert len(sky.launches("haru-local--alpha")) == 1
    clock.advance(ms=60_000)
    relaunched = await tick_until(
        reconciler, store, lambda f: domain(f, "alpha").launch_attempt == 2
    )
    assert domain(relaunched, "alpha").state is DomainState.PROVISIONING
    [relaunch] = await events(store, ready.id, EventType.DOMAIN_RELAUNCH)
    assert (relaunch.payload["relaunch"], relaunch.payload["maxAttempts"]) == (1, 1)
    started = [
        e
        for e in await events(store, ready.id, EventType.DOMAIN_LAUNCH_STARTED)
        if e.domain_id == alpha_id
    ]
    assert [(e.payload["attempt"], e.payload["role"]) for e in started] == [
        (1, "active"),
        (2, "standby"),
    ]
    async with asyncio.timeout(10):
        while len(sky.launches("haru-local--alpha")) < 2:
            await asyncio.sleep(0.02)
    # It is lost again: relaunchMaxAttempts (1) is spent, so it stays failed, said once.
    await tick_until(reconciler, store, lambda f: domain(f, "alpha").launched_at is not None)
    sky.set_status("haru-local--alpha", None)
    await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))
    clock.advance(ms=10 * 60_000)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    relaunches = await events(store, ready.id, EventType.DOMAIN_RELAUNCH)
    assert [e.payload["exhausted"] for e in relaunches] == [False, True]
    assert len(sky.launches("haru-local--alpha")) == 2


async def test_relaunch_switch_off_leaves_a_lost_domain_failed(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    layout = bare_layout(relaunchBackoffBaseMs=1_000)
    document = layout.model_dump(mode="json", by_alias=True, exclude_none=True)
    document["domains"][1]["provisioning"] = {"relaunch": False}
    await store.apply_fleet_layout(FleetLayout.model_validate(document), at=clock())
    reconciler, _ = make_reconciler(store)
    await tick_until(reconciler, store, lambda f: domain(f, "beta").supervisor_url is not None)
    sky.set_status("haru-local--beta", "STOPPED")
    # Still provisioning (no supervisor answers here): the loss fails it all the same.
    lost = await tick_until(reconciler, store, in_state("beta", DomainState.FAILED))
    clock.advance(ms=3_600_000)
    for _ in range(3):
        await reconciler.tick("local")
    assert domain(await snapshot(store), "beta").state is DomainState.FAILED
    assert len(sky.launches("haru-local--beta")) == 1
    assert await events(store, lost.id, EventType.DOMAIN_RELAUNCH) == []


async def test_domain_status_up_and_down_through_the_api(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky, aiohttp_client: AiohttpClient
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    fleet = await snapshot(store)
    # Both domains launched and addressed as the lifecycle leaves them, then ready.
    for slug in ("alpha", "beta"):
        got = domain(fleet, slug)
        assert await store.claim_launch(got.id, expected_attempt=0, at=clock())
        assert await store.mark_launched(got.id, attempt=1, at=clock())
        assert await store.record_domain_address(
            got.id,
            attempt=1,
            supervisor_url="http://127.0.0.1:9",
            serving_base_url="http://127.0.0.1:9",
            model_urls={},
            at=clock(),
        )
        assert await store.transition_domain(
            got.id, from_states=(DomainState.PROVISIONING,), to=DomainState.READY, at=clock()
        )
        sky.set_status(f"haru-local--{slug}", "UP")
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )

    response = await client.get("/v1/fleets/local/domains/beta")
    assert response.status == 200
    body = await response.json()
    assert (body["role"], body["clusterName"], body["clusterStatus"]) == (
        "standby",
        "haru-local--beta",
        "UP",
    )
    assert body["domain"]["state"] == "ready"
    base = str(client.server.make_url("/"))
    shown = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["domain", "status", "local", "beta", "--url", base]
    )
    assert shown.exit_code == 0, shown.output
    assert "cluster haru-local--beta: UP" in shown.output
    refused = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["domain", "down", "local", "alpha", "--url", base]
    )
    assert refused.exit_code == 1
    assert "409" in refused.output
    response = await client.get("/v1/fleets/local/domains/nope")
    assert response.status == 404
    assert (await response.json())["error"]["code"] == "not_found"

    # `down` is refused for the active domain: 409 with a clear message, nothing moves.
    response = await client.post("/v1/fleets/local/domains/alpha/down")
    assert response.status == 409
    error = (await response.json())["error"]
    assert error["code"] == "operation_conflict"
    assert "active domain" in error["message"]
    assert domain(await snapshot(store), "alpha").state is DomainState.READY

    # `down` of the standby: stopping, then `sky down` in the background, then stopped.
    response = await client.post("/v1/fleets/local/domains/beta/down")
    assert response.status == 202
    assert (await response.json())["domain"]["state"] == "stopping"
    for _ in range(200):
        await client.post("/v1/fleets/local/reconcile")
        if domain(await snapshot(store), "beta").state is DomainState.STOPPED:
            break
        await asyncio.sleep(0.02)
    assert domain(await snapshot(store), "beta").state is DomainState.STOPPED
    assert [c["argv"] for c in sky.calls() if c["argv"][:1] == ["down"]] == [
        ["down", "haru-local--beta", "-y"]
    ]
    assert "haru-local--beta" not in sky.clusters()
    response = await client.get("/v1/fleets/local/domains/beta")
    body = await response.json()
    assert body["clusterStatus"] == "absent"
    assert [e["type"] for e in body["events"]][-2:] == [
        "domain.down.requested",
        "domain.teardown",
    ]

    # `up` launches it again (attempt 2, as a standby); `up` of a ready domain is refused.
    response = await client.post("/v1/fleets/local/domains/alpha/up")
    assert response.status == 409
    clock.advance(ms=1_000)
    up = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["domain", "up", "local", "beta", "--url", base]
    )
    assert up.exit_code == 0, up.output
    assert "provisioning" in up.output
    await client.post("/v1/fleets/local/reconcile")
    beta = domain(await snapshot(store), "beta")
    assert beta.launch_attempt == 2
    started = await events(store, fleet.id, EventType.DOMAIN_LAUNCH_STARTED)
    assert [(e.payload["attempt"], e.payload["role"]) for e in started] == [(2, "standby")]


async def test_the_relaunch_streak_survives_a_server_restart(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(
        bare_layout(relaunchBackoffBaseMs=1_000, relaunchMaxAttempts=2), at=clock()
    )
    name = "haru-local--alpha"

    async def launched_then_lost(reconciler: Reconciler, attempt: int) -> None:
        await tick_until(
            reconciler,
            store,
            lambda f: (
                domain(f, "alpha").launch_attempt == attempt
                and domain(f, "alpha").supervisor_url is not None
            ),
        )
        sky.set_status(name, None)  # preempted: SkyPilot forgets the cluster
        await tick_until(reconciler, store, in_state("alpha", DomainState.FAILED))

    first, first_provisioner = make_reconciler(store)
    await launched_then_lost(first, 1)
    clock.advance(ms=1_000)
    await tick_until(first, store, lambda f: domain(f, "alpha").launch_attempt == 2)
    await launched_then_lost(first, 2)
    await first_provisioner.close()

    # A new server process: relaunch 2 of 2, after the doubled backoff, not a fresh streak.
    second, second_provisioner = make_reconciler(store)
    clock.advance(ms=1_999)
    for _ in range(3):
        await second.tick("local")
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    clock.advance(ms=1)
    await tick_until(second, store, lambda f: domain(f, "alpha").launch_attempt == 3)
    fleet = await snapshot(store)
    relaunches = await events(store, fleet.id, EventType.DOMAIN_RELAUNCH)
    assert [(e.payload["relaunch"], e.payload["backoffMs"]) for e in relaunches] == [
        (1, 1_000),
        (2, 2_000),
    ]
    await launched_then_lost(second, 3)
    await second_provisioner.close()

    # Spent: a third process neither relaunches nor says so twice.
    for _ in range(2):
        third, third_provisioner = make_reconciler(store)
        clock.advance(ms=3_600_000)
        for _ in range(3):
            await third.tick("local")
        await third_provisioner.close()
    assert domain(await snapshot(store), "alpha").state is DomainState.FAILED
    assert len(sky.launches(name)) == 3
    relaunches = await events(store, fleet.id, EventType.DOMAIN_RELAUNCH)
    assert [(e.payload["relaunch"], e.payload["exhausted"]) for e in relaunches] == [
        (1, False),
        (2, False),
        (2, True),
    ]

    # `haru domain up` starts a fresh streak: its next loss is relaunched again.
    alpha = domain(await snapshot(store), "alpha")
    assert await store.transition_domain(
        alpha.id, from_states=(DomainState.FAILED,), to=DomainState.PROVISIONING, at=clock()
    )
    await store.append_event(
        fleet_id=fleet.id,
        payload=DomainUpRequested(from_state=DomainState.FAILED),
        at=clock(),
        domain_id=alpha.id,
    )
    fourth, _ = make_reconciler(store)
    await launched_then_lost(fourth, 4)
    clock.advance(ms=1_000)
    await tick_until(fourth, store, lambda f: domain(f, "alpha").launch_attempt == 5)
    relaunches = await events(store, fleet.id, EventType.DOMAIN_RELAUNCH)
    assert (relaunches[-1].payload["relaunch"], relaunches[-1].payload["backoffMs"]) == (1, 1_000)


async def test_down_of_a_former_active_waits_out_the_route_guard(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky, aiohttp_client: AiohttpClient
) -> None:
    """A domain routing just moved away from is not taken down while a lease may reach it.

    A promotion never sleeps a skyserve old active (always awake), so it ends right after its
    flip; a ``down`` of that domain would then stop what a process with a long route lease
    still routes to. It is refused (409) until the guard has run out since the flip.
    """
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    fleet = await snapshot(store)
    for slug in ("alpha", "beta"):
        got = domain(fleet, slug)
        assert await store.claim_launch(got.id, expected_attempt=0, at=clock())
        assert await store.mark_launched(got.id, attempt=1, at=clock())
        assert await store.record_domain_address(
            got.id,
            attempt=1,
            supervisor_url="http://127.0.0.1:9",
            serving_base_url="http://127.0.0.1:9",
            model_urls={},
            at=clock(),
        )
        assert await store.transition_domain(
            got.id, from_states=(DomainState.PROVISIONING,), to=DomainState.READY, at=clock()
        )
        sky.set_status(f"haru-local-{slug}", "UP")
    alpha, beta = domain(fleet, "alpha").id, domain(fleet, "beta").id
    assert await store.record_route_lease(fleet.id, 10_000)  # a proxy process's lease
    # Another replica's promotion of beta: the flip, its event, and its end at once.
    promote, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    assert await store.claim_operation(
        promote.id, first_step=OperationStep.SWITCH_ACTIVE, at=clock()
    )
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=alpha,
        target_domain_id=beta,
        operation_id=promote.id,
        at=clock(),
    )
    await store.append_event(
        fleet_id=fleet.id,
        payload=RoutingSwitched(from_domain_id=alpha, to_domain_id=beta, route_revision=None),
        at=clock(),
        domain_id=beta,
        operation_id=promote.id,
    )
    assert await store.complete_operation(
        promote.id, from_step=OperationStep.SWITCH_ACTIVE, at=clock()
    )
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )

    clock.advance(ms=lease_guard_ms(10_000) - 1)
    response = await client.post("/v1/fleets/local/domains/alpha/down")
    assert response.status == 409
    error = (await response.json())["error"]
    assert error["code"] == "operation_conflict"
    assert "route lease" in error["message"]
    assert domain(await snapshot(store), "alpha").state is DomainState.READY

    clock.advance(ms=1)
    response = await client.post("/v1/fleets/local/domains/alpha/down")
    assert response.status == 202
    assert (await response.json())["domain"]["state"] == "stopping"


async def test_addresses_are_skypilots_endpoints_of_each_port(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    # RunPod, Vast and Kubernetes LoadBalancers publish a port under another port: the
    # head's IP with the task's port would lead nowhere.
    sky.configure(port_offset=30_000)
    await store_layout(sqlite_store, clock)
    reconciler, _ = make_reconciler(sqlite_store)
    done = await tick_until(
        reconciler, sqlite_store, lambda f: domain(f, "alpha").supervisor_url is not None
    )
    alpha = domain(done, "alpha")
    assert str(alpha.supervisor_url) == "https://127.0.0.1:38701"  # over TLS (fleet CA)
    assert str(alpha.serving_base_url) == "https://127.0.0.1:38000"  # the gateway too
    asked = [c["argv"] for c in sky.calls() if "--endpoint" in c["argv"]]
    assert ["status", "--endpoint", "8701", "haru-local--alpha"] in asked
    assert not [c for c in sky.calls() if "--ip" in c["argv"]]


async def store_layout(store: StateStore, clock: ManualClock, **policy: Any) -> None:
    await store.apply_fleet_layout(bare_layout(**policy), at=clock())


async def test_one_refreshed_status_call_reads_every_cluster(
    sqlite_store: StateStore, make_reconciler: Any, clock: ManualClock, sky: FakeSky
) -> None:
    # The two clusters come up in the same read: alpha's launch ends first and its cluster
    # stays INIT (and asked for) until beta's is asked for too; beta, read alone once alpha
    # is UP, comes up after its own second read.
    sky.configure(
        up_together=["haru-local--alpha", "haru-local--beta"],
        launch={"haru-local--beta": {"delay": 1.0}},
    )
    await store_layout(sqlite_store, clock)
    reconciler, _ = make_reconciler(sqlite_store)
    await tick_until(
        reconciler,
        sqlite_store,
        lambda f: all(d.supervisor_url is not None for d in f.domains),
    )
    reads = [c["argv"] for c in sky.calls() if c["argv"][:1] == ["status"]]
    both = ["status", "haru-local--alpha", "haru-local--beta", "--refresh", "-o", "json"]
    assert both in reads
    # Every other read is refreshed too, but for each launch's check for a leftover cluster.
    unrefreshed = [r for r in reads if "--endpoint" not in r and "--refresh" not in r]
    assert sorted(unrefreshed) == [
        ["status", f"haru-local--{slug}", "-o", "json"] for slug in ("alpha", "beta")
    ]


async def test_a_sky_older_than_the_minimum_launches_nothing(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky, caplog: pytest.LogCaptureFixture
) -> None:
    sky.configure(version="0.11.2")
    await store_layout(sqlite_store, clock)
    provisioner = Provisioner(
        sqlite_store,
        SkyPilotDriver(SkyRunner(retry_delay=0)),
        clock=clock,
        supervisor_token=TOKEN,
        options=ProvisionerOptions(status_interval_s=0),
    )
    try:
        async with asyncio.timeout(10):
            while "older than 0.12.0" not in caplog.text:
                await provisioner.provision_round(await snapshot(sqlite_store), None)
                await asyncio.sleep(0.02)
        for _ in range(3):
            await provisioner.provision_round(await snapshot(sqlite_store), None)
    finally:
        await provisioner.close()
    assert [c["argv"] for c in sky.calls()] == [["--version"]]
    assert all(d.launch_attempt == 0 for d in (await snapshot(sqlite_store)).domains)


async def test_launches_beyond_the_limit_wait_their_turn(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky
) -> None:
    sky.configure(launch={"haru-local--alpha": {"hang": True}})
    await store_layout(sqlite_store, clock)
    provisioner = Provisioner(
        sqlite_store,
        SkyPilotDriver(SkyRunner(retry_delay=0)),
        clock=clock,
        supervisor_token=TOKEN,
        serving_token=SERVING_TOKEN,
        options=ProvisionerOptions(status_interval_s=0, max_concurrent_launches=1, preflight=False),
        pki=FleetPki(sqlite_store, STORE_KEY),
    )
    try:
        for _ in range(2):
            await provisioner.provision_round(await snapshot(sqlite_store), None)
        fleet = await snapshot(sqlite_store)
        assert [d.launch_attempt for d in fleet.domains] == [1, 1]  # both claimed
        async with asyncio.timeout(10):
            while "haru-local--alpha" not in sky.clusters():
                await asyncio.sleep(0.02)
        for _ in range(3):
            await provisioner.provision_round(await snapshot(sqlite_store), None)
        assert sky.launches("haru-local--beta") == []  # queued behind alpha's
        pid = sky.launch_pid("haru-local--alpha")
        os.kill(pid, 9)  # alpha's launch ends (failed): beta's turn
        async with asyncio.timeout(10):
            while not sky.launches("haru-local--beta"):
                await provisioner.provision_round(await snapshot(sqlite_store), None)
                await asyncio.sleep(0.02)
    finally:
        await provisioner.close()


async def test_a_domain_removed_by_apply_is_torn_down_out_of_the_fleets_snapshot(
    sqlite_store: StateStore, clock: ManualClock, sky: FakeSky
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(bare_layout(), at=clock())
    fleet = await snapshot(store)
    beta = domain(fleet, "beta")
    name = "haru-local--beta"
    assert await store.claim_launch(beta.id, expected_attempt=0, at=clock())
    await store.append_event(
        fleet_id=fleet.id,
        payload=DomainLaunchStarted(cluster=name, attempt=1, role="standby"),
        at=clock(),
        domain_id=beta.id,
    )
    assert await store.mark_launched(beta.id, attempt=1, at=clock())
    sky.set_status(name, "UP")
    revision = (await store.get_config_revisions(fleet.id))[("domain", beta.id)]
    assert await store.remove_domain(beta.id, fleet_id=fleet.id, revision=revision, at=clock())
    assert [d.slug for d in (await snapshot(store)).domains] == ["alpha"]
    driver = SkyPilotDriver(SkyRunner(retry_delay=0))
    provisioner = Provisioner(
        store,
        driver,
        clock=clock,
        supervisor_token=TOKEN,
        serving_token=SERVING_TOKEN,
        options=ProvisionerOptions(status_interval_s=0, preflight=False),
        pki=FleetPki(store, STORE_KEY),
    )
    try:
        for _ in range(100):
            await provisioner.provision_round(await snapshot(store), None)
            if not await store.list_removed_teardowns(fleet.id):
                break
            await asyncio.sleep(0.02)
        assert await store.list_removed_teardowns(fleet.id) == []
    finally:
        await provisioner.close()
    assert sky.downs(name)
    assert name not in sky.clusters()
    [teardown] = [e for e in await events(store, fleet.id) if e.type == "domain.teardown"]
    assert (teardown.domain_id, teardown.payload["ok"]) == (beta.id, True)
    assert [d.slug for d in (await snapshot(store)).domains] == ["alpha"]
