"""A provisioned domain's task: the supervisor config, ``run``, secrets and the node helper."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import (
    TOKEN_SECRET,
    SkyPilotDriver,
    SkyRunner,
    domain_task,
    example_domain_layout,
    example_domain_task,
    model_ports,
    node_helper_source,
    render_task_yaml,
    supervisor_config,
)
from haru_protocol import SupervisorConfig

FAKE_SKY = """\
#!{python}
import json, os, pathlib, sys
state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{"argv": args, "token": os.environ.get("HARU_SUPERVISOR_TOKEN")}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")
if args[:1] == ["launch"]:
    (state / "up").write_text(args[2])
elif args[:2] == ["status", "--ip"]:
    up = state / "up"
    if up.exists() and up.read_text() == args[2]:
        print("\\x1b[0m10.1.2.3")
    else:
        print(f"Cluster(s) not found: {{args[2]}}.")
"""


@pytest.fixture
def fake_sky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    state = tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "sky"
    script.write_text(FAKE_SKY.format(python=sys.executable, state=str(state)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv(TOKEN_SECRET, raising=False)
    return state


def test_supervisor_config_matches_the_slots() -> None:
    task = example_domain_task(start_asleep=False)
    assert task.ports == (8701, 8000)
    config = yaml.safe_load(render_task_yaml(task))
    run = config["run"]
    start = run.index("<<'HARU_CONFIG_EOF'\n") + len("<<'HARU_CONFIG_EOF'\n")
    embedded = SupervisorConfig.model_validate_json(run[start : run.index("\nHARU_CONFIG_EOF")])
    assert [(s.kind.value, s.gpu_index) for s in embedded.slots] == [
        ("inference", 0),
        ("inference", 1),
        ("training", 0),
        ("training", 1),
    ]
    ports = {m.name: m.port for s in embedded.inference_slots for m in s.models}
    assert ports == {
        "example-chat-small": 8100,
        "example-chat-medium": 8101,
        "example-chat-large": 8102,
    }
    assert embedded.training_slots[0].command == ("python", "train.py", "--lora")


def test_the_script_never_puts_a_server_to_sleep_behind_the_supervisors_back() -> None:
    # A late sleep from the script raced a promotion that had woken the domain (CI, the
    # SkyPilot end-to-end test): only the supervisor, driven by the reconciler, sleeps vLLM.
    asleep = example_domain_task(start_asleep=True).run
    awake = example_domain_task(start_asleep=False).run
    assert asleep == awake
    script = asleep.split("HARU_NODE_EOF")[-1]
    assert "sleep-when-ready" not in script
    assert "/sleep" not in script
    for run in (asleep, awake):
        assert "export VLLM_SERVER_DEV_MODE=1" in run
        assert run.rstrip().endswith('exec "$SUPERVISOR"')


def test_the_token_is_a_secret_never_a_value() -> None:
    task = example_domain_task(start_asleep=True)
    config = yaml.safe_load(render_task_yaml(task))
    assert config["secrets"] == {TOKEN_SECRET: None}
    assert TOKEN_SECRET not in config["envs"]


def test_the_node_helper_is_embedded_verbatim() -> None:
    run = example_domain_task(start_asleep=True).run
    assert node_helper_source() in run


async def test_launch_passes_the_token_through_the_environment(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner())
    task = example_domain_task(start_asleep=True)
    token = "a-secret-token-of-sufficient-length"
    await driver.launch_domain(task, secrets={TOKEN_SECRET: token})
    assert await driver.get_head_ip(task.name) == "10.1.2.3"
    assert await driver.get_head_ip("haru-other") is None
    launch, *_ = [json.loads(line) for line in (fake_sky / "calls.jsonl").read_text().splitlines()]
    assert launch["argv"][:7] == ["launch", "-c", task.name, "-y", "-d", "--secret", TOKEN_SECRET]
    assert launch["token"] == token
    assert token not in launch["yaml"]
    assert token not in " ".join(launch["argv"])


async def test_launch_without_the_secret_value_is_refused(fake_sky: Path) -> None:
    from haru_driver_skypilot import InvalidSpecError

    with pytest.raises(InvalidSpecError, match="HARU_SUPERVISOR_TOKEN"):
        await SkyPilotDriver(SkyRunner()).launch_domain(example_domain_task(start_asleep=True))
    assert not (fake_sky / "calls.jsonl").exists()


# ---- the gateway, as a real process in front of a real HTTP server ----


class _Upstream(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        payload = json.dumps({"path": self.path, "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _answer  # noqa: N815
    do_POST = _answer  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway(tmp_path: Path, upstream: int) -> Iterator[int]:
    script = tmp_path / "haru_node.py"
    script.write_text(node_helper_source())
    argv = [sys.executable, str(script), "gateway", "--host", "127.0.0.1", "--listen", "0"]
    proc = subprocess.Popen(
        [*argv, "--route", f"example-chat-small={upstream}"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def _call(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers={"content-type": "application/json"})
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, data


async def test_gateway_forwards_only_inference_routes(gateway: int) -> None:
    status, data = await asyncio.to_thread(
        _call, gateway, "POST", "/m/example-chat-small/v1/chat/completions", b'{"x": 1}'
    )
    assert status == 200
    assert json.loads(data) == {"path": "/v1/chat/completions", "body": '{"x": 1}'}
    status, data = await asyncio.to_thread(_call, gateway, "GET", "/m/example-chat-small/v1/models")
    assert (status, json.loads(data)["path"]) == (200, "/v1/models")
    for method, path in [
        ("POST", "/m/example-chat-small/sleep?level=1"),
        ("POST", "/m/example-chat-small/wake_up"),
        ("GET", "/m/example-chat-small/is_sleeping"),
        ("POST", "/m/unknown/v1/chat/completions"),
        ("POST", "/v1/chat/completions"),
    ]:
        status, _ = await asyncio.to_thread(_call, gateway, method, path, b"")
        assert status == 404, path


def test_model_ports_count_up_in_layout_order() -> None:
    domain = example_domain_layout()
    ports = model_ports(domain.slots, domain.settings)
    assert [(p.name, p.gpu_index, p.port) for p in ports] == [
        ("example-chat-small", 0, 8100),
        ("example-chat-medium", 0, 8101),
        ("example-chat-large", 1, 8102),
    ]
    config = supervisor_config(domain.slots, domain.settings)
    assert [m.port for s in config.inference_slots for m in s.models] == [8100, 8101, 8102]


def test_setup_installs_the_pinned_packages_unless_the_image_has_them() -> None:
    domain = example_domain_layout()
    task = example_domain_task(start_asleep=False)
    assert task.setup is not None
    assert "pip install --upgrade vllm==0.33.0 haru-supervisor==0.1.0" in task.setup
    assert "setup" in yaml.safe_load(render_task_yaml(task))
    document = domain.model_dump(mode="json", by_alias=True, exclude_none=True)
    document["provisioning"]["install"] = False
    image = type(domain).model_validate(document)
    prebuilt = domain_task(
        "haru-demo-beta", image.placement, image.slots, image.settings, start_asleep=False
    )
    assert prebuilt.setup is None
    assert "setup" not in yaml.safe_load(render_task_yaml(prebuilt))
    assert prebuilt.run == task.run
