"""A skyserve domain's service: structure, the endpoint URL, and the gateway's readiness route."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import InvalidSpecError, cluster_name, node_helper_source
from haru_driver_skyserve import READINESS_PATH, domain_service, endpoint_url, service_config
from haru_protocol import DomainLayout


def domain(**provisioning: object) -> DomainLayout:
    return DomainLayout.model_validate(
        {
            "slug": "alpha",
            "provider": "skyserve",
            "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"},
            "provisioning": provisioning,
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [{"name": "chat-a"}, {"name": "chat-b", "source": "org/b"}],
                }
            ],
        }
    )


def test_the_service_is_the_domain_less_the_supervisor() -> None:
    layout = domain(replicas=3, gatewayPort=9000, readinessInitialDelayS=5400)
    spec = domain_service(
        cluster_name("demo", "alpha"), layout.placement, layout.slots, layout.settings
    )
    config = service_config(spec)
    assert config["name"] == "haru-demo--alpha"
    # SkyServe's default delay (1,200 s) can be shorter than a vLLM install plus a model load.
    probe = {"path": READINESS_PATH, "initial_delay_seconds": 5400}
    assert config["service"] == {"readiness_probe": probe, "replicas": 3, "ports": 9000}
    assert config["resources"]["ports"] == [9000]
    # No supervisor: nothing installs, configures or starts it, and no token is asked for.
    assert "secrets" not in config
    assert "haru-supervisor" not in config["setup"]
    assert "vllm==0.33.0" in config["setup"]
    run = config["run"]
    assert "supervisor.json" not in run
    assert "HARU_SUPERVISOR" not in run
    assert "sleep-when-ready" not in run.split("HARU_NODE_EOF")[-1]
    assert run.count('CUDA_VISIBLE_DEVICES=0 nohup "$VLLM" serve') == 2
    assert "serve org/b --served-model-name chat-b --host 127.0.0.1 --port 8101" in run
    # The gateway is the replica's foreground process (its exit ends the replica).
    assert run.splitlines()[-1] == (
        'exec "$PYTHON" "$HARU_DIR/haru_node.py" gateway --listen 9000 '
        "--route chat-a=8100 --route chat-b=8101"
    )
    assert yaml.safe_load(yaml.safe_dump(config)) == config


@pytest.mark.parametrize(
    ("shown", "url"),
    [
        ("34.1.2.3:30001", "http://34.1.2.3:30001"),
        ("http://34.1.2.3:30001/", "http://34.1.2.3:30001"),
        ("https://svc.example.org", "https://svc.example.org"),
        ("[2001:db8::1]:30001", "http://[2001:db8::1]:30001"),
    ],
)
def test_endpoint_url(shown: str, url: str) -> None:
    assert endpoint_url(shown) == url


@pytest.mark.parametrize("shown", ["", "-x y:1", "ftp://h:1", "h:99999", "h:port"])
def test_endpoint_url_refuses_what_is_no_endpoint(shown: str) -> None:
    with pytest.raises(InvalidSpecError, match="is not HOST:PORT"):
        endpoint_url(shown)


# ---- the gateway's readiness route, as a real process ----


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def healthy() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gateway(tmp_path: Path, routes: dict[str, int]) -> subprocess.Popen[str]:
    script = tmp_path / "haru_node.py"
    script.write_text(node_helper_source())
    argv = [sys.executable, str(script), "gateway", "--host", "127.0.0.1", "--listen", "0"]
    for name, port in routes.items():
        argv += ["--route", f"{name}={port}"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    answer = conn.getresponse()
    body = json.loads(answer.read())
    conn.close()
    return answer.status, body


@pytest.mark.parametrize("down", [False, True])
async def test_gateway_health_needs_every_model(tmp_path: Path, healthy: int, down: bool) -> None:
    routes = {"chat-a": healthy, "chat-b": _closed_port() if down else healthy}
    proc = _gateway(tmp_path, routes)
    assert proc.stdout is not None
    try:
        port = int((await asyncio.to_thread(proc.stdout.readline)).rsplit(":", 1)[1])
        status, body = await asyncio.to_thread(_get, port, READINESS_PATH)
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
    if down:
        assert (status, body) == (503, {"ok": False, "notHealthy": ["chat-b"]})
    else:
        assert (status, body) == (200, {"ok": True, "notHealthy": []})
