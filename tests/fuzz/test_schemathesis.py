"""Schemathesis against both running services, from their own ``/openapi.json``.

Real sockets: the control server on 127.0.0.1 with a SQLite store seeded with a local fleet
(emulated vLLM servers behind real supervisors, domains confirmed) and a token; then one of
that fleet's supervisors. Bounded: a fixed number of examples per operation, a per-request
timeout (a request that hangs fails the run) and an overall bound on each run. Checks: no 5xx,
documented statuses, content types and bodies, invalid input refused with a 4xx, auth enforced,
405 with ``Allow`` for other methods, and every error in the envelope (``st_hooks``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web
from haru_db import StateStore, upgrade
from haru_db.testing import confirm_domains
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_server._app import create_app
from haru_server._settings import Settings
from pydantic import SecretStr

pytestmark = [pytest.mark.slow, pytest.mark.fuzz, pytest.mark.timeout(600)]

API_TOKEN = "fuzz-api-token-0123456789"
SUPERVISOR_TOKEN = "fuzz-supervisor-token-0123456789"
EXAMPLES = 25
"""Examples per operation and phase (the run takes about a minute per service)."""
REQUEST_TIMEOUT_S = 20
RUN_BOUND_S = 240
CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "missing_required_header",
        "unsupported_method",
        "allow_header_conformance",
        "ignored_auth",
        "error_envelope",
    )
)


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert isinstance(site.port, int)
    return runner, f"http://127.0.0.1:{site.port}"


async def schemathesis_run(
    base: str, token: str, workdir: Path, *, fleet: str | None = None
) -> tuple[int, str]:
    """Run the schemathesis CLI against ``base``; its exit status and output.

    ``fleet`` pins the ``{ref}`` path parameter to a fleet that exists, so the cases reach the
    routes' logic (queries, bodies, operations) instead of stopping at 404 ``fleet_not_found``.
    """
    config = workdir / "schemathesis.toml"
    config.write_text(
        "" if fleet is None else f'[parameters]\n"path.ref" = "{fleet}"\n', encoding="utf-8"
    )
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "st_hooks",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "NO_COLOR": "1",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{base}/openapi.json",
        "--header",
        f"Authorization: Bearer {token}",
        "--checks",
        CHECKS,
        "--max-examples",
        str(EXAMPLES),
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--seed",
        "1",
        "--workers",
        "1",
        "--no-shrink",
        "--suppress-health-check",
        "all",
        "--report",
        "junit",
        "--report-dir",
        str(workdir / "report"),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(RUN_BOUND_S):
            output, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"schemathesis did not finish within {RUN_BOUND_S}s") from None
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[LocalFleet]:
    options = LocalFleetOptions(supervisor_token=SUPERVISOR_TOKEN)
    async with LocalFleet(tmp_path / "fleet", options) as started:
        yield started


async def test_control_server_survives_schemathesis(fleet: LocalFleet, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fuzz.db'}"
    await upgrade(url)
    store = StateStore.open(url)
    try:
        now = datetime.now(UTC)
        await store.apply_fleet_layout(fleet.layout(), at=now)
        await confirm_domains(store, fleet.options.slug, at=now)
        settings = Settings(
            database_url=url,
            api_token=SecretStr(API_TOKEN),
            supervisor_token=SecretStr(SUPERVISOR_TOKEN),
            default_fleet=fleet.options.slug,
            reconcile_interval_ms=None,
        )
        runner, base = await serve(create_app(settings, store=store))
        try:
            code, output = await schemathesis_run(
                base, API_TOKEN, tmp_path, fleet=fleet.options.slug
            )
        finally:
            await runner.cleanup()
    finally:
        await store.close()
    assert code == 0, output


async def test_supervisor_survives_schemathesis(fleet: LocalFleet, tmp_path: Path) -> None:
    supervisor = next(iter(fleet.domains.values())).supervisor_url
    assert supervisor
    code, output = await schemathesis_run(supervisor, SUPERVISOR_TOKEN, tmp_path)
    assert code == 0, output
