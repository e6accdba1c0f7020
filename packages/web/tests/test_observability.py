"""Request ids, the logging setup and the /metrics route, over real sockets."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import aiohttp
import pytest
from aiohttp import web
from haru_protocol import MAX_REQUEST_ID_LENGTH, REQUEST_ID_HEADER, ErrorCode, is_request_id
from haru_web import (
    ApiError,
    LogFormat,
    ServerLimits,
    accept_request_id,
    add_metrics_route,
    bearer_middleware,
    browser_guard_middleware,
    configure_logging,
    current_request_id,
    error_middleware,
    install_request_ids,
    metrics_guarded,
    new_request_id,
    parse_log_format,
    parse_log_level,
    request_id_middleware,
    request_id_scope,
    serving,
)
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

TOKEN = "web-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
log = logging.getLogger("haru_web.tests")


def build_app(*, token: str | None, public_metrics: bool = False) -> web.Application:
    app = web.Application(
        middlewares=[
            request_id_middleware,
            error_middleware,
            browser_guard_middleware(open_api=token is None),
            bearer_middleware(token, guarded=metrics_guarded(public=public_metrics)),
        ]
    )
    install_request_ids(app)
    registry = CollectorRegistry()
    hits = Counter("haru_test_hits", "Hits.", registry=registry)

    async def hit(_request: web.Request) -> web.Response:
        hits.inc()
        log.info("hit served")
        return web.json_response({"requestId": current_request_id()})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"chunk")
        return response

    async def fail(_request: web.Request) -> web.Response:
        log.warning("about to fail")
        raise ApiError(ErrorCode.INVALID_REQUEST, "no")

    app.router.add_post("/v1/hit", hit)
    app.router.add_get("/v1/stream", stream)
    app.router.add_get("/v1/fail", fail)
    add_metrics_route(app, registry)
    return app


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
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


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    app = build_app(token=TOKEN)
    async with serving(
        app, host="127.0.0.1", port=0, limits=ServerLimits(), shutdown_timeout=1.0
    ) as listening:
        yield listening.url


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("abc-123", True),
        ("0f8fad5b-d9cb-469f-a165-70867728950e", True),
        ("trace:span/1+x=", True),
        ("a" * MAX_REQUEST_ID_LENGTH, True),
        ("a" * (MAX_REQUEST_ID_LENGTH + 1), False),
        ("", False),
        ("-leading", False),
        ("has space", False),
        ('quote"', False),
        ("new\nline", False),
        ("ünicode", False),
    ],
)
def test_request_id_rule(value: str, ok: bool) -> None:
    assert is_request_id(value) is ok
    accepted = accept_request_id(value)
    assert (accepted == value) is ok
    assert is_request_id(accepted)


def test_new_request_ids_are_32_random_hex_digits() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert is_request_id(rid)


def test_scope_keeps_the_current_id_and_makes_one_outside_requests() -> None:
    assert current_request_id() is None
    with request_id_scope() as outer:
        assert current_request_id() == outer
        with request_id_scope() as inner:
            assert inner == outer
        with request_id_scope("given") as given:
            assert given == "given"
        assert current_request_id() == outer
    assert current_request_id() is None


def test_env_parsers() -> None:
    assert parse_log_level(None) == logging.INFO
    assert parse_log_level(" debug ") == logging.DEBUG
    assert parse_log_format("") == "text"
    assert parse_log_format("JSON") == "json"
    with pytest.raises(ValueError, match="must be one of"):
        parse_log_level("verbose")
    with pytest.raises(ValueError, match="must be one of"):
        parse_log_format("xml")


async def test_request_ids_are_accepted_made_echoed_and_logged(
    base_url: str, captured: io.StringIO
) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base_url}/v1/hit", headers={REQUEST_ID_HEADER: "given-1"}) as r:
            assert r.headers[REQUEST_ID_HEADER] == "given-1"
            assert (await r.json())["requestId"] == "given-1"
        async with http.post(f"{base_url}/v1/hit", headers={REQUEST_ID_HEADER: "bad id!"}) as r:
            made = r.headers[REQUEST_ID_HEADER]
            assert made != "bad id!"
            assert is_request_id(made)
            assert (await r.json())["requestId"] == made
        # Echoed on errors (the envelope) and on streamed answers too.
        async with http.get(f"{base_url}/v1/fail", headers={REQUEST_ID_HEADER: "fail-1"}) as r:
            assert r.status == 400
            assert r.headers[REQUEST_ID_HEADER] == "fail-1"
        async with http.get(f"{base_url}/v1/stream", headers={REQUEST_ID_HEADER: "st-1"}) as r:
            assert await r.read() == b"chunk"
            assert r.headers[REQUEST_ID_HEADER] == "st-1"
        async with http.get(f"{base_url}/nowhere", headers={REQUEST_ID_HEADER: "nf-1"}) as r:
            assert r.status == 404
            assert r.headers[REQUEST_ID_HEADER] == "nf-1"
    records = lines(captured)
    served = [r for r in records if r["message"] == "hit served"]
    assert [r["request_id"] for r in served] == ["given-1", made]
    assert all(r["logger"] == "haru_web.tests" and r["level"] == "INFO" for r in served)
    failing = next(r for r in records if r["message"] == "about to fail")
    assert failing["request_id"] == "fail-1"
    access = [r for r in records if r["logger"] == "aiohttp.access"]
    by_id = {r["request_id"]: r for r in access}
    assert by_id["given-1"]["status"] == 200
    assert by_id["given-1"]["path"] == "/v1/hit"
    assert by_id["given-1"]["level"] == "INFO"
    assert by_id["st-1"]["level"] == "DEBUG"  # a successful read: a poll, quiet
    assert by_id["fail-1"]["level"] == "INFO"


def test_text_format_appends_the_request_id() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    handler = configure_logging(log_format="text", level=logging.INFO, stream=stream)
    try:
        with request_id_scope("text-1"):
            log.info("inside")
        log.info("outside")
    finally:
        root.removeHandler(handler)
        for old in before[0]:
            root.addHandler(old)
        root.setLevel(before[1])
    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith("haru_web.tests: inside request_id=text-1")
    assert outside.endswith("haru_web.tests: outside")


def test_text_format_appends_context_fields_once_and_escaped() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    handler = configure_logging(log_format="text", level=logging.INFO, stream=stream)
    fields = {"fleet": "local", "domain": "beta", "domain_id": "d1", "operation_id": "o1"}
    try:
        with request_id_scope("text-2"):
            log.info("step done", extra={**fields, "step": "probe"})
        log.info("proxy fleet=%s", "local", extra={"fleet": "local", "model": "m"})
        log.info("odd", extra={"fleet": "a\nb"})
    finally:
        root.removeHandler(handler)
        for old in before[0]:
            root.addHandler(old)
        root.setLevel(before[1])
    step, proxy, odd = stream.getvalue().splitlines()
    assert step.endswith(
        "step done fleet=local domain=beta domain_id=d1 operation_id=o1 step=probe "
        "request_id=text-2"
    )
    assert proxy.endswith("haru_web.tests: proxy fleet=local")  # spelled out once
    assert odd.endswith("haru_web.tests: odd fleet=a\\nb")


_RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_times_are_rfc3339_utc_with_milliseconds(log_format: LogFormat) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    handler = configure_logging(log_format=log_format, level=logging.INFO, stream=stream)
    try:
        earliest = datetime.now(UTC).replace(microsecond=0)
        log.info("stamped")
        latest = datetime.now(UTC)
    finally:
        root.removeHandler(handler)
        for old in before[0]:
            root.addHandler(old)
        root.setLevel(before[1])
    line = stream.getvalue().rstrip("\n")
    stamp = json.loads(line)["time"] if log_format == "json" else line.split(" ", 1)[0]
    assert _RFC3339_UTC.fullmatch(stamp), line
    assert earliest <= datetime.fromisoformat(stamp) <= latest, (stamp, earliest, latest)


async def test_metrics_behind_the_token_unless_public() -> None:
    for public in (False, True):
        app = build_app(token=TOKEN, public_metrics=public)
        async with (
            serving(
                app, host="127.0.0.1", port=0, limits=ServerLimits(), shutdown_timeout=1.0
            ) as listening,
            aiohttp.ClientSession() as http,
        ):
            async with http.post(f"{listening.url}/v1/hit", headers=AUTH) as r:
                assert r.status == 200
            async with http.get(f"{listening.url}/metrics") as r:
                assert r.status == (200 if public else 401)
            async with http.get(f"{listening.url}/metrics", headers=AUTH) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                families = {f.name: f for f in text_string_to_metric_families(await r.text())}
            # The app's own registry: one hit, no process-wide collectors.
            assert families["haru_test_hits"].samples[0].value == 1
            assert "python_gc_objects_collected" not in families
