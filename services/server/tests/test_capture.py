"""Haru's parts as separate hosts, and what a packet capture of their links shows.

Network namespaces on a private bridge (``haru_sim.netlab``): two GPU hosts (``alpha``,
``beta``: an emulated vLLM server on the host's loopback, the real ``haru-gateway`` in front of
it and the real ``haru-supervisor``, both serving HTTPS only) and a ``client`` host that talks
to the server through the ``openai`` SDK over HTTPS. The server runs in this process on the
bridge's address; it reaches each GPU host through a userspace delay relay (20 ms each way:
40 ms RTT, as between two regions; these kernels have no ``netem``), verifying the gateways
against ``HARU_SERVING_CA_FILE`` and presenting the gateway's serving credential (the static
binding's ``apiKeyEnv``). ``tshark`` captures the bridge (every veth's frames cross it) during
a whole promotion and 100 chat requests; the capture must hold neither token, nor the serving
credential, nor any prompt or completion, nor any clear-text HTTP.

Skipped with the reason where namespaces or ``tshark`` are missing; a failure under ``CI``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_db import StateStore, upgrade
from haru_protocol import FleetLayout
from haru_server._settings import Settings
from haru_sim.netlab import DelayRelay, Host, Lab
from haru_sim.nvidia_smi import EmulatedGpu, GpuModel, write_nvidia_smi
from pydantic import SecretStr

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces: Linux"),
    # tshark and real TLS across namespaces, about 15 s: the slow lane runs it.
    pytest.mark.slow,
]

RunningServer = Callable[[Settings], AbstractAsyncContextManager[str]]

SUPERVISOR_TOKEN = "sup-tok-capture-8c1f0e5a"
API_TOKEN = "api-tok-capture-3b7d22e9"
MODEL = "chat"
VLLM_PORT = 8100
GATEWAY_PORT = 8000
SUPERVISOR_PORT = 8701
SERVING_KEY_VAR = "HARU_TEST_CAPTURE_SERVING_KEY"
SERVING_KEY = "serving-key-capture-61d9a4f2"
DELAY_S = 0.020
CHATS = 100
DEADLINE_S = 90.0


@pytest.fixture
def tshark() -> str:
    found = shutil.which("tshark")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but tshark is not installed")
        pytest.skip("tshark is not installed")
    return found


def start_gpu_host(
    host: Host,
    tmp: Path,
    pki: Any,
    *,
    gateway: str,
    asleep: bool,
    cert: tuple[Path, Path] | None = None,
) -> None:
    """An emulated vLLM server, a TLS gateway and a TLS supervisor in ``host`` (all die with
    the lab). vLLM listens on the host's loopback only: the gateway is its one way in."""
    home = tmp / host.name
    bin_dir = home / "bin"
    gpu = EmulatedGpu(index=0, models=(GpuModel(name=MODEL, port=VLLM_PORT, awake_mib=30_000),))
    write_nvidia_smi(bin_dir, [gpu])
    config = home / "supervisor.json"
    config.write_text(
        json.dumps(
            {
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 0,
                        "models": [{"name": MODEL, "port": VLLM_PORT}],
                    }
                ]
            }
        )
    )
    vllm = [sys.executable, "-m", "haru_sim.vllm", "--host", "127.0.0.1", "--port", str(VLLM_PORT)]
    vllm += ["--served-model-name", MODEL, *(["--start-asleep"] if asleep else [])]
    host.popen(vllm, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cert_file, key_file = cert or leaf(pki, home, host.name, host.address, gateway)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HARU_SUPERVISOR_CONFIG": str(config),
        "HARU_HOST": "0.0.0.0",
        "PORT": str(SUPERVISOR_PORT),
        "HARU_SUPERVISOR_TOKEN": SUPERVISOR_TOKEN,
        "HARU_TLS_CERT_FILE": str(cert_file),
        "HARU_TLS_KEY_FILE": str(key_file),
    }
    gateway_argv = [sys.executable, "-m", "haru_supervisor._gateway", "--listen", str(GATEWAY_PORT)]
    gateway_argv += ["--token-env", SERVING_KEY_VAR, "--route", f"{MODEL}={VLLM_PORT}"]
    with (home / "gateway.log").open("wb") as log:
        host.popen(
            gateway_argv,
            env={**env, SERVING_KEY_VAR: SERVING_KEY},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    supervisor = [sys.executable, "-m", "haru_supervisor"]
    with (home / "supervisor.log").open("wb") as log:
        host.popen(supervisor, env=env, stdout=log, stderr=subprocess.STDOUT)


def leaf(
    pki: Any, where: Path, name: str, *hosts: str, expired: bool = False, ca: Any = None
) -> tuple[Path, Path]:
    """A certificate from the test CA (or ``ca``) for ``hosts``: (cert, key)."""
    now = datetime.now(UTC)
    issued = (ca or pki.ca).issue_cert(
        *hosts,
        not_before=now - timedelta(days=10) if expired else None,
        not_after=now - timedelta(days=1) if expired else None,
    )
    where.mkdir(parents=True, exist_ok=True)
    cert, key = where / f"{name}.crt", where / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


def layout(urls: dict[str, tuple[str, str]]) -> FleetLayout:
    domains = [
        {
            "slug": slug,
            "supervisorUrl": supervisor,
            "placement": {"cloud": "aws", "region": "local", "accelerator": "EXAMPLE-GPU"},
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [
                        {"name": MODEL, "servingUrl": serving, "apiKeyEnv": SERVING_KEY_VAR}
                    ],
                }
            ],
        }
        for slug, (supervisor, serving) in urls.items()
    ]
    return FleetLayout.model_validate(
        {
            "slug": "local",
            "activeDomainSlug": "alpha",
            "policy": {"autoFailover": False},
            "domains": domains,
        }
    )


FIELDS = ("-e", "tcp.stream", "-e", "tcp.srcport", "-e", "tcp.dstport", "-e", "tcp.payload")


def streams(tshark: str, pcap: Path) -> dict[str, bytes]:
    """Every TCP stream's payload, both directions in capture order, by ``"PORT_A-PORT_B"``."""
    out = subprocess.run(
        [tshark, "-r", str(pcap), "-Y", "tcp.len > 0", "-T", "fields", *FIELDS],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    found: dict[str, bytearray] = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) != 4 or not parts[3]:
            continue
        ports = "-".join(sorted(parts[1:3], key=int))
        found.setdefault(f"{parts[0]}:{ports}", bytearray()).extend(
            bytes.fromhex(parts[3].replace(":", ""))
        )
    return {k: bytes(v) for k, v in found.items()}


CLIENT = """
import json, ssl, sys
import httpx2
from openai import OpenAI
base, token, ca, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
trust = ssl.create_default_context(cafile=ca)
client = OpenAI(base_url=base + "/v1", api_key=token, http_client=httpx2.Client(verify=trust))
answers = []
for i in range(count):
    text = f"secret prompt number {i} about zanzibar"
    got = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": text}], max_tokens=8
    )
    answers.append(got.choices[0].message.content)
print(json.dumps(answers))
"""


async def test_a_capture_of_a_promotion_and_chats_holds_no_token_and_no_prompt(
    running_server: RunningServer,
    netlab: Lab,
    tshark: str,
    pki: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SERVING_KEY_VAR, SERVING_KEY)
    capture_file = tmp_path / "links.pcapng"
    lab = netlab
    alpha, beta, client = lab.host("alpha"), lab.host("beta"), lab.host("client")
    gw = lab.gateway
    start_gpu_host(alpha, tmp_path, pki, gateway=gw, asleep=False)
    start_gpu_host(beta, tmp_path, pki, gateway=gw, asleep=True)
    relays: list[DelayRelay] = []
    urls: dict[str, tuple[str, str]] = {}
    stack = contextlib.AsyncExitStack()
    for host in (alpha, beta):
        sup = DelayRelay((gw, 0), (host.address, SUPERVISOR_PORT), delay_s=DELAY_S)
        gateway = DelayRelay((gw, 0), (host.address, GATEWAY_PORT), delay_s=DELAY_S)
        for relay in (sup, gateway):
            await stack.enter_async_context(relay)
        relays += [sup, gateway]
        # The server's link to the serving endpoint (through the relay) is HTTPS too.
        urls[host.name] = (
            f"https://{gw}:{sup.address[1]}",
            f"https://{gw}:{gateway.address[1]}/m/{MODEL}",
        )
    db = f"sqlite:///{tmp_path / 'haru.db'}"
    await upgrade(db)
    store = StateStore.open(db)
    try:
        await store.apply_fleet_layout(layout(urls), at=datetime.now(UTC))
    finally:
        await store.close()
    server_cert, server_key = leaf(pki, tmp_path, "server", gw)
    settings = Settings(
        database_url=db,
        bind_host=gw,
        port=0,
        api_token=SecretStr(API_TOKEN),
        proxy_accept_admin_token=True,
        supervisor_token=SecretStr(SUPERVISOR_TOKEN),
        tls_cert_file=server_cert,
        tls_key_file=server_key,
        supervisor_ca_file=pki.ca_file,
        serving_ca_file=pki.ca_file,
        default_fleet="local",
        reconcile_interval_ms=200,
    )
    capture = await asyncio.create_subprocess_exec(
        *[tshark, "-i", lab.bridge, "-w", str(capture_file)],
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert capture.stderr is not None
    async with asyncio.timeout(30):  # it says so once the interface is open
        while b"Capturing on" not in await capture.stderr.readline():
            pass
    try:
        async with running_server(settings) as url:
            auth = {"Authorization": f"Bearer {API_TOKEN}"}
            context = ssl.create_default_context(cafile=str(pki.ca_file))
            async with aiohttp.ClientSession(headers=auth) as http:

                async def fleet() -> dict[str, Any]:
                    async with http.get(f"{url}/v1/fleets/local", ssl=context) as resp:
                        assert resp.status == 200, await resp.text()
                        body: dict[str, Any] = await resp.json()
                        return body

                async def until(what: str, done: Any) -> dict[str, Any]:
                    async with asyncio.timeout(DEADLINE_S):
                        while not done(current := await fleet()):
                            await asyncio.sleep(0.2)
                    return current

                def ids(f: dict[str, Any]) -> dict[str, str]:
                    return {d["slug"]: d["id"] for d in f["domains"]}

                ready = await until(
                    "both ready",
                    lambda f: all(d["state"] == "ready" for d in f["domains"]),
                )
                async with http.post(
                    f"{url}/v1/fleets/local/promote",
                    json={"targetDomainId": ids(ready)["beta"]},
                    ssl=context,
                ) as resp:
                    assert resp.status == 202, await resp.text()
                await until(
                    "beta active",
                    lambda f: (
                        f["activeDomainId"] == ids(f)["beta"]
                        and f.get("reconciled") is not None
                        and all(
                            s["state"] == "serving"
                            for d in f["domains"]
                            if d["slug"] == "beta"
                            for s in d["slots"]
                        )
                    ),
                )
            done = await asyncio.create_subprocess_exec(
                *client.argv(
                    [sys.executable, "-c", CLIENT, url, API_TOKEN, str(pki.ca_file), str(CHATS)]
                ),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            async with asyncio.timeout(DEADLINE_S):
                out, err = await done.communicate()
            assert done.returncode == 0, err.decode(errors="replace")[-2000:]
            answers = json.loads(out)
    finally:
        capture.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await capture.communicate()
        await stack.aclose()
    assert len(answers) == CHATS
    assert answers[7] == "secret prompt number 7 about zanzibar"[: len(answers[7])]
    captured = streams(tshark, capture_file)
    assert captured, "the capture holds no TCP payload at all"
    server_port = url.rsplit(":", 1)[1]
    everything = b"".join(captured.values())
    for secret in (SUPERVISOR_TOKEN, API_TOKEN, SERVING_KEY):
        assert secret.encode() not in everything, f"{secret} crossed a link in clear text"
    # Proof that the capture sees every kind of link: the client's (HTTPS to the server) and
    # the server's (its relays, on this host) to the gateways and to the supervisors.
    ports = {port for key in captured for port in key.split(":")[1].split("-")}
    assert {server_port, str(GATEWAY_PORT), str(SUPERVISOR_PORT)} <= ports
    # Every link holds no text at all: no prompt, no completion, no clear-text HTTP.
    for key, data in captured.items():
        assert b"zanzibar" not in data, f"prompt or completion text in stream {key}"
        assert b"HTTP/1.1" not in data, f"clear-text HTTP in stream {key}"


@pytest.mark.parametrize("wrong", ["expired", "stranger", "pinned"])
async def test_a_wrong_certificate_across_the_link_fails_clearly_and_sends_nothing(
    running_server: RunningServer, netlab: Lab, tshark: str, pki: Any, tmp_path: Path, wrong: str
) -> None:
    lab = netlab
    gw = lab.gateway
    alpha = lab.host("alpha")
    cert = leaf(
        pki,
        tmp_path,
        "alpha-wrong",
        alpha.address,
        gw,
        expired=wrong == "expired",
        ca=pki.other if wrong == "stranger" else None,
    )
    start_gpu_host(alpha, tmp_path, pki, gateway=gw, asleep=False, cert=cert)
    expected = {
        "expired": "certificate has expired",
        "stranger": "certificate verif",
        "pinned": "is not the pinned",
    }[wrong]
    async with (
        DelayRelay((gw, 0), (alpha.address, SUPERVISOR_PORT), delay_s=DELAY_S) as sup,
        DelayRelay((gw, 0), (alpha.address, VLLM_PORT), delay_s=DELAY_S) as vllm,
    ):
        address = f"{gw}:{sup.address[1]}"
        db = f"sqlite:///{tmp_path / 'haru.db'}"
        await upgrade(db)
        store = StateStore.open(db)
        try:
            urls = {"alpha": (f"https://{address}", f"http://{gw}:{vllm.address[1]}")}
            await store.apply_fleet_layout(layout(urls), at=datetime.now(UTC))
        finally:
            await store.close()
        # "pinned": the certificate chains to the trusted CA, but the operator pinned another.
        pins = {address: bytes(32)} if wrong == "pinned" else {}
        settings = Settings(
            database_url=db,
            port=0,
            supervisor_token=SecretStr(SUPERVISOR_TOKEN),
            supervisor_ca_file=pki.ca_file,
            supervisor_pins=pins,
            default_fleet="local",
            reconcile_interval_ms=200,
        )
        capture_file = tmp_path / "wrong.pcapng"
        capture = await asyncio.create_subprocess_exec(
            *[tshark, "-i", lab.bridge, "-w", str(capture_file)],
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert capture.stderr is not None
        try:
            async with asyncio.timeout(30):
                while b"Capturing on" not in await capture.stderr.readline():
                    pass
            async with running_server(settings) as url, aiohttp.ClientSession() as http:
                async with asyncio.timeout(DEADLINE_S):
                    while True:
                        async with http.get(f"{url}/v1/fleets/local") as resp:
                            [domain] = (await resp.json())["domains"]
                        # Until the supervisor listens, the relay's refusal is the error.
                        if expected in (domain.get("lastSupervisorError") or ""):
                            break
                        await asyncio.sleep(0.2)
        finally:
            capture.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):
                await capture.communicate()
    assert expected in domain["lastSupervisorError"]
    assert domain["state"] != "ready"
    everything = b"".join(streams(tshark, capture_file).values())
    # Refused during the handshake: no request, token or clear-text retry ever left.
    assert SUPERVISOR_TOKEN.encode() not in everything
    assert b"/v1/status" not in everything
