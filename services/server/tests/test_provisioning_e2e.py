"""End to end: two ``skypilot`` domains from ``haru seed`` to a serving fleet, a promotion and
the preemption of the active, with the rendered ``run`` script really running on 127.0.0.1.

The fake ``sky`` (``fake_sky_node.py``) runs each launched task's ``run`` unchanged: the
supervisor config, ``vllm serve ...`` per model and the serving gateway (``haru-gateway``,
behind the serving credential the server presents) come from the renderer, with a ``vllm``
wrapper first on the PATH that starts the emulator (``haru-sim-vllm serve``, which reads
``vllm serve``'s command line), the real ``haru-supervisor`` and an emulated ``nvidia-smi``
whose memory follows the emulated servers and trainers. The server runs in this process on a
real port with its reconcile loop; the operator's commands go through the ``haru`` CLI.
Nothing in the layout names a URL.

Each supervisor serves HTTPS with the key and certificate the server issued from the fleet's
CA before its launch (delivered only as ``sky launch --secret``), and the server reaches it
over ``https://``, trusting only that CA and checking the domain's name.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from haru_db import StateStore
from haru_demo import EmulatedGpu, GpuModel, write_nvidia_smi
from haru_driver_skypilot import TLS_KEY_SECRET, cluster_name, model_ports
from haru_protocol import (
    DomainLayout,
    DomainSnapshot,
    DomainState,
    EventType,
    FleetSnapshot,
    InferenceSlotSpec,
    InferenceSlotState,
    TrainingSlotState,
)
from haru_server._settings import Settings
from haru_server.api import create_app
from haru_server.cli import app as cli_app
from pydantic import SecretStr
from pytest_aiohttp import AiohttpServer
from typer.testing import CliRunner

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"),
        reason="the fake sky finds a node's processes in /proc",
    ),
    # About 35 s of real processes: CI runs it in the slow lane, beside the rest.
    pytest.mark.slow,
]

TOKEN = "tok-e2e-supervisor-secret-0815"
SERVING_TOKEN = "serving-e2e-credential-5d1f"
FAKE_SKY = Path(__file__).with_name("fake_sky_node.py")
# A name with a slash and a space: the gateway path carries it percent-encoded, and the run
# script names the log file by index.
LARGE = "org/chat large"
MODELS = (("chat-small", "example-org/chat-small"), (LARGE, None))
AWAKE_MIB = 30_000
DEADLINE_S = 60.0


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` consecutive free TCP ports none of which is in ``taken``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        start = probe.getsockname()[1]
    for base in range(start, start + 2_000):
        block = list(range(base, base + count))
        if block[-1] < 65_536 and all(p not in taken and _free(p) for p in block):
            taken.update(block)
            return block
    raise AssertionError("no free port block")


class Sky:
    """The fake ``sky`` of one test: its state directory and its hand (preemption)."""

    def __init__(self, state: Path, shims: Path) -> None:
        self.state = state
        self.env = {**os.environ, "FAKE_SKY_STATE": str(state), "FAKE_SKY_SHIMS": str(shims)}

    def calls(self) -> list[dict[str, Any]]:
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def launches(self, name: str) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["argv"][:1] == ["launch"] and name in c["argv"]]

    def listed(self) -> set[str]:
        """The clusters the fake SkyPilot lists."""
        return {
            p.name.removeprefix("cluster-").removesuffix(".json")
            for p in self.state.glob("cluster-*.json")
        }

    def node(self, name: str) -> Path:
        return self.state / "nodes" / name

    async def run(self, *argv: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(FAKE_SKY), *argv, env=self.env
        )
        assert await proc.wait() == 0

    def kill_all(self) -> None:
        """What ``sky down`` does to every node this test launched (nothing may outlive it)."""
        nodes = self.state / "nodes"
        for node in sorted(nodes.iterdir()) if nodes.exists() else ():
            subprocess.run(
                [sys.executable, str(FAKE_SKY), "down", node.name], check=True, env=self.env
            )


@pytest.fixture
def sky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sky]:
    bin_dir = tmp_path / "bin"
    shims = tmp_path / "shims"
    state = tmp_path / "sky-state"
    for folder in (bin_dir, shims, state):
        folder.mkdir()
    wrappers = {
        # The folders are baked into the wrapper: `sky` gets none of the test's variables.
        bin_dir / "sky": (
            f'FAKE_SKY_STATE="{state}" FAKE_SKY_SHIMS="{shims}" '
            f'exec "{sys.executable}" "{FAKE_SKY}" "$@"'
        ),
        # `vllm serve ...` of the run script starts the emulator with the same command line.
        shims / "vllm": f'exec "{sys.executable}" -m haru_sim.vllm "$@"',
    }
    for path, line in wrappers.items():
        path.write_text(f"#!/bin/sh\n{line}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    fake = Sky(state, shims)
    yield fake
    fake.kill_all()


def domain_document(slug: str, tmp_path: Path, taken: set[int]) -> dict[str, Any]:
    supervisor_port, gateway_port = free_ports(1, taken)[0], free_ports(1, taken)[0]
    base = free_ports(len(MODELS), taken)[0]
    models: list[dict[str, Any]] = []
    for name, source in MODELS:
        models.append({"name": name} if source is None else {"name": name, "source": source})
    trainer = [sys.executable, "-m", "haru_sim.trainer", "--step-ms", "20"]
    return {
        "slug": slug,
        "provider": "skypilot",
        "placement": {
            "cloud": "gcp",
            "region": "us-central1",
            "accelerator": "L4",
            "useSpot": True,
        },
        "provisioning": {
            "install": False,
            "supervisorPort": supervisor_port,
            "gatewayPort": gateway_port,
            "vllmBasePort": base,
        },
        "slots": [
            {"kind": "inference", "gpuIndex": 0, "models": models},
            {
                "kind": "training",
                "gpuIndex": 0,
                "command": trainer,
                "checkpointDir": str(tmp_path / "checkpoints" / slug),
            },
        ],
    }


def give_nodes_a_gpu(sky: Sky, document: dict[str, Any]) -> None:
    """Each node's emulated ``nvidia-smi``: its models' ports (from the layout) and trainer."""
    for raw in document["domains"]:
        domain = DomainLayout.model_validate(raw)
        ports = model_ports(domain.slots, domain.settings)
        gpu = EmulatedGpu(
            index=0,
            models=tuple(GpuModel(name=p.name, port=p.port, awake_mib=AWAKE_MIB) for p in ports),
            checkpoint_dir=raw["slots"][1]["checkpointDir"],
        )
        write_nvidia_smi(sky.node(cluster_name("local", domain.slug)) / "bin", [gpu])


def by_slug(fleet: FleetSnapshot, slug: str) -> DomainSnapshot:
    return next(d for d in fleet.domains if d.slug == slug)


def serving(domain: DomainSnapshot) -> bool:
    return domain.state is DomainState.READY and all(
        s.state is InferenceSlotState.SERVING for s in domain.slots if s.kind == "inference"
    )


def standby_posture(domain: DomainSnapshot) -> bool:
    return domain.state is DomainState.READY and all(
        s.state
        is (InferenceSlotState.SLEEPING if s.kind == "inference" else TrainingSlotState.TRAINING)
        for s in domain.slots
    )


class Control:
    def __init__(self, base: str, http: aiohttp.ClientSession) -> None:
        self.base = base
        self.http = http

    async def fleet(self) -> FleetSnapshot:
        async with self.http.get(f"{self.base}/v1/fleets/local") as resp:
            assert resp.status == 200, await resp.text()
            return FleetSnapshot.model_validate_json(await resp.read())

    async def wait(self, what: str, done: Callable[[FleetSnapshot], bool]) -> FleetSnapshot:
        fleet = await self.fleet()
        try:
            async with asyncio.timeout(DEADLINE_S):
                while not done(fleet):
                    await asyncio.sleep(0.1)
                    fleet = await self.fleet()
        except TimeoutError:
            raise AssertionError(f"not reached: {what}; fleet: {fleet}") from None
        return fleet

    async def events(self, type_: str) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base}/v1/fleets/local/events?limit=1000") as resp:
            body = await resp.json()
        return [e for e in body["events"] if e["type"] == type_]

    async def chat(self, model: str, text: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        async with self.http.post(f"{self.base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["choices"][0]["message"]["content"])

    async def haru(self, *argv: str) -> str:
        result = await asyncio.to_thread(
            CliRunner().invoke, cli_app, [*argv[:1], *argv[1:], "--url", self.base]
        )
        assert result.exit_code == 0, result.output
        return result.output


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_two_skypilot_domains_from_seed_to_promotion_and_preemption(
    tmp_path: Path, sky: Sky, aiohttp_server: AiohttpServer, http: aiohttp.ClientSession
) -> None:
    taken: set[int] = set()
    document: dict[str, Any] = {
        "slug": "local",
        "activeDomainSlug": "alpha",
        # The failover's best-effort sleep of the lost active spends its budget before the
        # relaunch may start (no operation in flight): keep that budget short here.
        "policy": {
            "autoFailover": True,
            "relaunchBackoffBaseMs": 200,
            "sleepTimeoutMs": 2_000,
            # A fake launch returns within seconds; the hanging one below is cut at this.
            "launchTimeoutMs": 20_000,
        },
        "domains": [domain_document(slug, tmp_path, taken) for slug in ("alpha", "beta")],
    }
    give_nodes_a_gpu(sky, document)
    layout_path = tmp_path / "layout.json"
    layout_path.write_text(json.dumps(document))
    database = f"sqlite:///{tmp_path / 'haru.db'}"
    seeded = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["seed", str(layout_path), "--database-url", database]
    )
    assert seeded.exit_code == 0, seeded.output

    key_file = tmp_path / "store.key"
    key_file.write_bytes(Fernet.generate_key())
    settings = Settings(
        database_url=database,
        store_key_file=key_file,
        supervisor_token=SecretStr(TOKEN),
        serving_token=SecretStr(SERVING_TOKEN),
        default_fleet="local",
        reconcile_interval_ms=100,
        sky_status_interval_ms=0,
    )
    server = await aiohttp_server(create_app(settings))
    control = Control(str(server.make_url("")).rstrip("/"), http)
    ports = {d["slug"]: d["provisioning"] for d in document["domains"]}

    # Seed to a serving active and a sleeping, training standby: no URL was typed in.
    fleet = await control.wait(
        "alpha serving, beta in standby posture",
        lambda f: serving(by_slug(f, "alpha")) and standby_posture(by_slug(f, "beta")),
    )
    assert fleet.active_domain_id == by_slug(fleet, "alpha").id
    store = StateStore.open(database)
    try:
        stored_ca = await store.get_fleet_ca(fleet.id)
        certs = {c.domain_id: c for c in await store.list_domain_certs(fleet.id)}
    finally:
        await store.close()
    assert stored_ca is not None
    # The CA's key is sealed by the store key: the database never holds it in clear.
    assert "PRIVATE KEY" not in stored_ca.sealed_key
    fleet_ca = ssl.create_default_context(cadata=stored_ca.cert_pem)
    for slug in ("alpha", "beta"):
        domain = by_slug(fleet, slug)
        gateway = f"https://127.0.0.1:{ports[slug]['gatewayPort']}"
        assert str(domain.supervisor_url) == f"https://127.0.0.1:{ports[slug]['supervisorPort']}"
        name = f"{slug}.local.haru.internal"
        assert certs[domain.id].server_name == name
        # The key and certificate reached the node as secrets only, and became private files.
        [launch] = sky.launches(cluster_name("local", slug))
        assert TLS_KEY_SECRET in launch["argv"]
        tls_dir = sky.node(cluster_name("local", slug)) / "home" / ".haru" / "tls"
        assert stat.S_IMODE((tls_dir / "node.key").stat().st_mode) == 0o600
        assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
        served = x509.load_pem_x509_certificate((tls_dir / "node.crt").read_bytes())
        assert served.fingerprint(hashes.SHA256()).hex() == certs[domain.id].fingerprint
        key_pem = (tls_dir / "node.key").read_bytes()
        assert base64.b64encode(key_pem).decode() not in json.dumps(launch)
        assert str(domain.serving_base_url) == gateway
        urls = sorted(
            str(m.serving_url)
            for s in domain.slots
            if isinstance(s.spec, InferenceSlotSpec)
            for m in s.spec.models
        )
        assert urls == [f"{gateway}/m/chat-small", f"{gateway}/m/org%2Fchat%20large"]
        # The gateway serves only the server, which presents the serving credential, and
        # only over TLS with the domain's certificate from the fleet's CA.
        chat_url = f"{gateway}/m/chat-small/v1/chat/completions"
        async with http.post(chat_url, json={}, ssl=fleet_ca, server_hostname=name) as resp:
            assert resp.status == 401
            assert "chat" not in await resp.text()
        with pytest.raises(aiohttp.ClientError):
            await http.post(chat_url.replace("https://", "http://"), json={})
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.post(chat_url, json={}, ssl=fleet_ca, server_hostname=other_name(slug))
        assert TOKEN not in json.dumps(launch)
        assert SERVING_TOKEN not in json.dumps(launch)
        # The supervisor holds the token the secret carried, and nothing else opens it; it
        # speaks TLS only, with a certificate for the domain's name from the fleet's CA.
        status_url = f"{str(domain.supervisor_url).rstrip('/')}/v1/status"
        async with http.get(status_url, ssl=fleet_ca, server_hostname=name) as resp:
            assert resp.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(status_url, headers=auth, ssl=fleet_ca, server_hostname=name) as resp:
            assert resp.status == 200
        # Another domain's name: refused, although the same CA issued both.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.get(status_url, ssl=fleet_ca, server_hostname=other_name(slug))
        with pytest.raises(aiohttp.ClientError):
            await http.get(status_url.replace("https://", "http://"), headers=auth)
        # Each model is an emulated `vllm serve` on its generated port, with its source.
        base = ports[slug]["vllmBasePort"]
        for offset, (name, source) in enumerate(MODELS):
            async with http.get(f"http://127.0.0.1:{base + offset}/_sim/state") as resp:
                state = await resp.json()
            assert state["served_model_names"] == [name]
            async with http.get(f"http://127.0.0.1:{base + offset}/v1/models") as resp:
                assert (await resp.json())["data"][0]["root"] == (source or name)
    # The proxy reaches the gateway over TLS, trusting the fleet's CA under alpha's name.
    assert await control.chat("chat-small", "hello alpha") == "hello alpha"

    # A planned switchover through the CLI.
    await control.haru("promote", "local", "beta", "--wait", "--timeout", "60")
    fleet = await control.wait(
        "beta serving, alpha in standby posture",
        lambda f: (
            f.active_domain_id == by_slug(f, "beta").id
            and serving(by_slug(f, "beta"))
            and standby_posture(by_slug(f, "alpha"))
        ),
    )
    assert await control.chat(LARGE, "hello beta") == "hello beta"

    # The active's spot cluster is preempted: its machine dies and SkyPilot forgets it.
    beta_cluster = cluster_name("local", "beta")
    # ... and the region has no capacity left for the first relaunch.
    (sky.state / f"no-capacity-{beta_cluster}").touch()
    await sky.run("fake-preempt", beta_cluster)
    fleet = await control.wait(
        "failover to alpha",
        lambda f: f.active_domain_id == by_slug(f, "alpha").id and serving(by_slug(f, "alpha")),
    )
    assert await control.chat("chat-small", "after preemption") == "after preemption"
    [lost] = await control.events(EventType.DOMAIN_CLUSTER_LOST)
    assert (lost["payload"]["cluster"], lost["payload"]["role"]) == (beta_cluster, "active")
    # Relaunched by the fake sky running the run script again; it rejoins as a standby.
    fleet = await control.wait(
        "beta relaunched into standby posture", lambda f: standby_posture(by_slug(f, "beta"))
    )
    # The capacity error stayed in the relaunch streak: a second relaunch, after the backoff.
    assert by_slug(fleet, "beta").launch_attempt == 3
    assert len(sky.launches(beta_cluster)) == 3
    relaunches = await control.events(EventType.DOMAIN_RELAUNCH)
    assert [e["payload"]["relaunch"] for e in relaunches] == [1, 2]
    [failed] = [
        e
        for e in await control.events(EventType.DOMAIN_PROVISIONING_FAILED)
        if e["payload"]["cluster"] == beta_cluster
    ]
    assert "ResourcesUnavailableError" in failed["payload"]["stderr"]
    # The relaunch got a fresh certificate from the same CA, and the server trusts it.
    store = StateStore.open(database)
    try:
        renewed = {c.domain_id: c for c in await store.list_domain_certs(fleet.id)}
        assert await store.get_fleet_ca(fleet.id) == stored_ca
    finally:
        await store.close()
    beta_id = by_slug(fleet, "beta").id
    assert renewed[beta_id].attempt == 3
    assert renewed[beta_id].fingerprint != certs[beta_id].fingerprint
    started = [
        e["payload"]["role"]
        for e in await control.events(EventType.DOMAIN_LAUNCH_STARTED)
        if e["payload"]["cluster"] == beta_cluster
    ]
    assert started == ["standby", "standby", "standby"]
    # No cluster is left that Haru does not know about.
    assert sky.listed() == {cluster_name("local", "alpha"), beta_cluster}
    shown = await control.haru("domain", "status", "local", "beta")
    assert f"cluster {beta_cluster}: UP" in shown
    # The relaunched standby can take over again: a promotion back to it succeeds.
    await control.haru("promote", "local", "beta", "--wait", "--timeout", "60")
    fleet = await control.wait(
        "beta active again",
        lambda f: (
            f.active_domain_id == by_slug(f, "beta").id
            and serving(by_slug(f, "beta"))
            and standby_posture(by_slug(f, "alpha"))
        ),
    )
    assert await control.chat("chat-small", "back on beta") == "back on beta"

    # The standby goes down and up again, and its launch fails its setup: SkyPilot keeps
    # the cluster UP "for debugging"; Haru tears it down.
    alpha_cluster = cluster_name("local", "alpha")
    await control.haru("domain", "down", "local", "alpha")
    await control.wait("alpha stopped", lambda f: by_slug(f, "alpha").state is DomainState.STOPPED)
    assert sky.listed() == {beta_cluster}

    async def failed_and_cleaned(attempt: int) -> dict[str, Any]:
        await control.wait(
            f"alpha attempt {attempt} failed",
            lambda f: (
                by_slug(f, "alpha").state is DomainState.FAILED
                and by_slug(f, "alpha").launch_attempt == attempt
            ),
        )
        async with asyncio.timeout(DEADLINE_S):
            while sky.listed() != {beta_cluster}:  # nothing left that Haru does not know
                await asyncio.sleep(0.1)
        failures: list[dict[str, Any]] = [
            e["payload"]
            for e in await control.events(EventType.DOMAIN_PROVISIONING_FAILED)
            if e["payload"]["cluster"] == alpha_cluster and e["payload"]["attempt"] == attempt
        ]
        assert len(failures) == 1
        return failures[0]

    (sky.state / f"setup-fails-{alpha_cluster}").touch()
    await control.haru("domain", "up", "local", "alpha")
    assert (await failed_and_cleaned(2))["reason"] == "launch_failed"
    # A launch that hangs past launchTimeoutMs: killed, and the cluster its request left
    # behind is torn down too.
    (sky.state / f"hang-{alpha_cluster}").touch()
    await control.haru("domain", "up", "local", "alpha")
    assert (await failed_and_cleaned(3))["reason"] == "launch_timeout"
    assert len(sky.launches(alpha_cluster)) == 3


def other_name(slug: str) -> str:
    """The server name of the other domain of the fleet (same CA, not this domain's name)."""
    return f"{'beta' if slug == 'alpha' else 'alpha'}.local.haru.internal"
