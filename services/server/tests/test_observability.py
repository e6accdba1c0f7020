"""Metrics and logs end to end: a promotion through the server, its proxy and two supervisors.

The server app, two in-process supervisors and their emulated vLLM servers run on real sockets;
the server's and the supervisors' ``/metrics`` are scraped and parsed with prometheus_client's
text parser, and the JSON log lines of the whole run are parsed back.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from haru_db import StateStore
from haru_demo.localfleet import GPU_TOTAL_MIB, LocalFleet
from haru_protocol import REQUEST_ID_HEADER, InferenceSlotState, SlotKind
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from haru_web import configure_logging
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

MakeFleet = Callable[..., Awaitable[LocalFleet]]

TOKEN = "api-token-observability-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "zebra-quartz-prompt-7731 tell me about lighthouses"
MODEL = "example-chat-small"


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    handler = configure_logging(log_format="json", level=logging.DEBUG, stream=stream)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        for old in before[0]:
            root.addHandler(old)
        root.setLevel(before[1])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "haru-fleet.json"
RULES = ROOT / "deploy" / "prometheus" / "haru-rules.yml"
_METRIC_NAME = re.compile(r"\b(?:haru|process|python)_[a-z_]+\b")
_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


def exported_names(text: str) -> set[str]:
    """Every series name a scrape can hold, labelled children or not (HELP/TYPE count too)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in _SERIES_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [
        var["query"]["query"]
        for var in dashboard["templating"]["list"]
        if isinstance(var.get("query"), dict)
    ]
    return exprs


def rule_exprs() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


async def chat(api: TestClient[web.Request, web.Application], request_id: str) -> dict[str, Any]:
    response = await api.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
        headers={"X-Haru-Fleet": "local", REQUEST_ID_HEADER: request_id},
    )
    assert response.status == 200, await response.text()
    assert response.headers[REQUEST_ID_HEADER] == request_id
    body: dict[str, Any] = await response.json()
    return body


async def scrape(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> Samples:
    async with http.get(f"{url}/metrics", **kwargs) as response:
        assert response.status == 200
        return parse(await response.text())


async def test_promotion_moves_the_metrics_and_the_logs_share_request_ids(
    store: StateStore,
    clock: ManualClock,
    make_fleet: MakeFleet,
    helpers: Any,
    aiohttp_client: AiohttpClient,
    http: aiohttp.ClientSession,
    json_logs: io.StringIO,
) -> None:
    fleet = await make_fleet()
    snapshot = await helpers.seed(store, fleet, clock)
    api = await aiohttp_client(
        create_app(
            Settings(
                api_token=SecretStr(TOKEN),
                proxy_accept_admin_token=True,
                reconcile_interval_ms=None,
            ),
            store=store,
            clock=clock,
        ),
        headers=AUTH,
    )

    async def reconcile(request_id: str) -> dict[str, Any]:
        clock.advance(seconds=1)
        response = await api.post(
            "/v1/fleets/local/reconcile", headers={REQUEST_ID_HEADER: request_id}
        )
        assert response.status == 200
        assert response.headers[REQUEST_ID_HEADER] == request_id
        body: dict[str, Any] = await response.json()
        return body

    await reconcile("req-confirm")  # the first heartbeat confirms both domains
    await reconcile("req-standby")  # beta trains as a standby for 1 s
    first = await chat(api, "req-chat-1")
    beta = next(d.id for d in snapshot.domains if d.slug == "beta")
    accepted = await api.post("/v1/fleets/local/promote", json={"targetDomainId": str(beta)})
    assert accepted.status == 202
    operation = None
    for attempt in range(40):
        operation = (await reconcile(f"req-promote-{attempt}"))["operation"]
        if operation is not None and operation["state"] == "succeeded":
            break
    else:
        raise AssertionError(f"promotion did not finish: {operation}")
    promote_ids = {f"req-promote-{n}" for n in range(attempt + 1)}
    await reconcile("req-after-1")  # alpha's first heartbeat as a training standby
    await reconcile("req-after-2")  # ... and 1 s of it
    await chat(api, "req-chat-2")
    streamed = await api.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True},
        headers={"X-Haru-Fleet": "local", REQUEST_ID_HEADER: "req-stream"},
    )
    assert streamed.status == 200, await streamed.text()
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    assert (await streamed.text()).rstrip().endswith("data: [DONE]")

    # ---- the server's metrics ----------------------------------------------------------------
    async with http.get(f"{api.make_url('/metrics')}") as refused:
        assert refused.status == 401
    server = await scrape(http, str(api.make_url("")).rstrip("/"), headers=AUTH)
    chat_ok = {"fleet": "local", "model": MODEL, "route": "/v1/chat/completions", "status": "200"}
    assert value(server, "haru_proxy_requests_total", **chat_ok) == 3
    assert value(server, "haru_proxy_upstream_time_to_headers_seconds_count", fleet="local") == 3
    # Time to first token: only the streamed answer has one, labelled with its model.
    ttft = {"fleet": "local", "model": MODEL}
    assert value(server, "haru_proxy_time_to_first_token_seconds_count", **ttft) == 1
    assert total(server, "haru_proxy_time_to_first_token_seconds_count") == 1
    assert value(server, "haru_proxy_time_to_first_token_seconds_sum", **ttft) > 0
    # The route lease this process routes the fleet on (HARU_ROUTE_LEASE_MS): confirmed by a
    # read moments ago (the bound is loose: the machine may be slow, never the test).
    lease_age = server.get(("haru_route_lease_age_seconds", (("fleet", "local"),)))
    assert lease_age is not None
    assert 0 <= lease_age < 60, lease_age
    assert value(server, "haru_operations_started_total", kind="promote") == 1
    assert value(server, "haru_operations_succeeded_total", kind="promote") == 1
    assert total(server, "haru_operations_failed_total") == 0
    # Promotions by trigger and in total: the API's promote, created and ended in this process.
    assert value(server, "haru_operations_requested_total", kind="promote", trigger="manual") == 1
    assert total(server, "haru_operations_requested_total", trigger="automatic") == 0
    finished = {"kind": "promote", "outcome": "succeeded"}
    assert value(server, "haru_operation_duration_seconds_count", **finished) == 1
    # The app clock moved 1 s per reconcile from the request to the switch.
    assert value(server, "haru_operation_duration_seconds_sum", **finished) >= 1
    assert ("haru_proxy_held_requests_in_flight", ()) in server
    assert value(server, "haru_proxy_held_requests_in_flight") == 0
    for step in ("stop_training", "verify_gpu", "wake_vllm", "probe", "switch_active"):
        assert (
            value(
                server,
                "haru_operation_step_duration_seconds_count",
                kind="promote",
                step=step,
                outcome="done",
            )
            == 1
        ), step
    fresh = await store.get_fleet_snapshot("local")
    assert fresh is not None
    assert fresh.active_domain_id == beta
    assert value(server, "haru_fleet_route_revision", fleet="local") == fresh.route_revision
    assert value(server, "haru_fleet_active_domain", fleet="local", domain="beta") == 1
    assert total(server, "haru_fleet_active_domain", domain="alpha") == 0
    ticks = value(server, "haru_reconcile_ticks_total", result="ok")
    assert ticks == attempt + 5
    assert value(server, "haru_reconcile_tick_duration_seconds_count") == ticks
    assert total(server, "haru_heartbeat_failures_total") == 0
    assert total(server, "haru_state_store_errors_total") == 0
    assert total(server, "haru_proxy_stale_requests_total") == 0
    # The fleet row of the dashboard: every domain's state, the standbys able to take over, the
    # time since each domain's last answered heartbeat (this process's monotonic clock).
    assert value(server, "haru_domain_state", fleet="local", domain="beta", state="ready") == 1
    assert value(server, "haru_domain_state", fleet="local", domain="beta", state="failed") == 0
    assert value(server, "haru_domain_state", fleet="local", domain="alpha", state="ready") == 1
    assert value(server, "haru_fleet_standby_ready", fleet="local") == 1
    for domain in ("alpha", "beta"):
        age = server.get(
            ("haru_domain_heartbeat_age_seconds", (("domain", domain), ("fleet", "local")))
        )
        assert age is not None, domain
        assert 0 <= age < 60, (domain, age)
    build = [ls for (n, ls) in server if n == "haru_build_info"]
    assert len(build) == 1, build
    assert dict(build[0])["version"], build
    assert any(n == "process_cpu_seconds_total" for n, _ in server)
    assert any(n == "python_gc_collections_total" for n, _ in server)
    # Standby duty cycle: beta trained through its 1 s of standby before the promotion, alpha
    # through its seconds after it (the app clock moved 1 s per tick).
    assert value(server, "haru_standby_seconds_total", fleet="local", domain="beta") >= 1
    # Alpha's first standby second is the route guard's (it still answers requests routed by
    # an old lease, so its training waits): counted as standby, not as training.
    alpha_standby = value(server, "haru_standby_seconds_total", fleet="local", domain="alpha")
    alpha_training = value(
        server, "haru_standby_training_seconds_total", fleet="local", domain="alpha"
    )
    assert alpha_training >= 1
    assert alpha_standby == alpha_training + 1
    assert value(
        server, "haru_standby_duty_cycle_ratio", fleet="local", domain="alpha"
    ) == pytest.approx(alpha_training / alpha_standby)

    # ---- the supervisors' metrics ------------------------------------------------------------
    alpha_sup = await scrape(http, fleet.domain("alpha").supervisor_url)
    beta_sup = await scrape(http, fleet.domain("beta").supervisor_url)
    admin = "haru_supervisor_admin_calls_total"
    assert value(beta_sup, admin, action="training_stop", result="ok") >= 1
    assert value(beta_sup, admin, action="wake", result="ok") >= 1
    assert value(beta_sup, admin, action="probe", result="ok") >= 1
    assert value(beta_sup, admin, action="sleep", result="ok") == 0
    assert value(alpha_sup, admin, action="sleep", result="ok") >= 1
    assert value(alpha_sup, admin, action="training_start", result="ok") >= 1
    assert value(alpha_sup, admin, action="wake", result="ok") == 0
    assert value(alpha_sup, "haru_supervisor_action_duration_seconds_count", action="drain") >= 1
    assert value(beta_sup, "haru_supervisor_probe_results_total", model=MODEL, result="ok") >= 1
    assert value(alpha_sup, "haru_supervisor_training_runs", state="running") == 2
    assert value(beta_sup, "haru_supervisor_training_runs", state="idle") == 2
    # The last heartbeat's status: the new standby's server sleeps, the new active's is awake.
    assert value(alpha_sup, "haru_supervisor_vllm_sleeping", model=MODEL) == 1
    assert ("haru_supervisor_vllm_sleeping", (("model", MODEL),)) in beta_sup
    assert value(beta_sup, "haru_supervisor_vllm_sleeping", model=MODEL) == 0
    mib = 1024 * 1024
    assert value(beta_sup, "haru_supervisor_gpu_memory_total_bytes", gpu="0") == GPU_TOTAL_MIB * mib

    # ---- the shipped dashboard and alert rules name only what the services export -------------
    exported: set[str] = set()
    for url, headers in (
        (str(api.make_url("")).rstrip("/"), AUTH),
        (fleet.domain("alpha").supervisor_url, {}),
        (fleet.domain("beta").supervisor_url, {}),
    ):
        async with http.get(f"{url}/metrics", headers=headers) as response:
            exported |= exported_names(await response.text())
    for source, exprs in (("dashboard", dashboard_exprs()), ("rules", rule_exprs())):
        named = {name for expr in exprs for name in _METRIC_NAME.findall(expr)}
        assert len(named) >= 10, (source, named)
        assert named <= exported, (source, sorted(named - exported))

    # ---- the logs ----------------------------------------------------------------------------
    text = json_logs.getvalue()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    access = [r for r in records if r["logger"] == "haru_server.access"]
    by_id = {r["request_id"]: r for r in access}
    assert by_id["req-chat-2"]["fleet"] == "local"
    assert by_id["req-chat-2"]["model"] == MODEL
    assert by_id["req-chat-2"]["status"] == 200
    assert by_id["req-chat-2"]["upstream"] == fleet.domain("beta").sims[MODEL].url.rstrip("/")
    assert by_id["req-chat-2"]["upstream_headers_s"] >= 0
    assert by_id["req-chat-1"]["upstream"] == fleet.domain("alpha").sims[MODEL].url.rstrip("/")
    # The emulated vLLM received the request's id.
    received = [
        dict(r.headers).get(REQUEST_ID_HEADER)
        for r in fleet.domain("beta").sims[MODEL].recorded_requests
    ]
    assert "req-chat-2" in received
    # A server line and a supervisor line of the same promotion request share its id.
    supervisor_ids = {r["request_id"] for r in records if r["logger"] == "haru_supervisor.admin"}
    server_ids = {r["request_id"] for r in records if r["logger"].startswith("haru_server")}
    shared = supervisor_ids & server_ids & promote_ids
    assert shared, (supervisor_ids, server_ids)
    wake = next(
        r for r in records if r["logger"] == "haru_supervisor.admin" and r["action"] == "wake"
    )
    assert wake["request_id"] in promote_ids
    # The reconciler's lines about the promotion name its fleet, target domain, operation and
    # step as fields, not only inside the message text.
    assert operation is not None
    about = [
        r
        for r in records
        if r["logger"].startswith(("haru_server._operation_driver", "haru_server._steps"))
        and operation["id"] in r["message"]
    ]
    assert len(about) >= 5, about
    for record in about:
        assert record["fleet"] == "local", record
        assert record["fleet_id"] == str(snapshot.id), record
        assert record["domain"] == "beta", record
        assert record["domain_id"] == str(beta), record
        assert record["operation_id"] == operation["id"], record
        assert record["operation_kind"] == "promote", record
    steps = {r["step"] for r in about if "done, next" in r["message"]}
    assert {"stop_training", "verify_gpu", "wake_vllm", "probe"} <= steps, steps
    # No token, prompt or answer text anywhere in the log.
    answer = first["choices"][0]["message"]["content"]
    assert len(answer) >= 8
    for secret in (TOKEN, "zebra-quartz", answer):
        assert secret not in text


async def test_a_known_model_that_cannot_be_served_keeps_its_label(
    store: StateStore,
    clock: ManualClock,
    make_fleet: MakeFleet,
    helpers: Any,
    aiohttp_client: AiohttpClient,
    http: aiohttp.ClientSession,
) -> None:
    fleet = await make_fleet()
    snapshot = await helpers.seed(store, fleet, clock)
    api = await aiohttp_client(
        create_app(
            Settings(
                api_token=SecretStr(TOKEN),
                proxy_accept_admin_token=True,
                reconcile_interval_ms=None,
                failover_hold_ms=0,
            ),
            store=store,
            clock=clock,
        ),
        headers=AUTH,
    )
    clock.advance(seconds=1)
    assert (await api.post("/v1/fleets/local/reconcile")).status == 200
    alpha = next(d for d in snapshot.domains if d.slug == "alpha")
    for slot in alpha.slots:
        if slot.kind is SlotKind.INFERENCE:
            assert await store.transition_slot(
                slot.id,
                kind=SlotKind.INFERENCE,
                from_states=[InferenceSlotState.SERVING],
                to=InferenceSlotState.FAILED,
                at=clock(),
            )
    headers = {"X-Haru-Fleet": "local"}
    body = {"messages": [{"role": "user", "content": PROMPT}]}
    failed = await api.post("/v1/chat/completions", json={"model": MODEL, **body}, headers=headers)
    assert failed.status == 503, await failed.text()
    unknown = await api.post(
        "/v1/chat/completions", json={"model": "no-such-model", **body}, headers=headers
    )
    assert unknown.status == 404
    server = await scrape(http, str(api.make_url("")).rstrip("/"), headers=AUTH)
    route = "/v1/chat/completions"
    labels = {"fleet": "local", "route": route}
    assert value(server, "haru_proxy_requests_total", model=MODEL, status="503", **labels) == 1
    assert value(server, "haru_proxy_requests_total", model="unknown", status="404", **labels) == 1
