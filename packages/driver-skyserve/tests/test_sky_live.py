"""Both drivers against real SkyPilot 0.14.1: its ``sky`` CLI and SDK, with a local API server.

No cloud is touched: the queries name clusters and services that do not exist, which is
exactly the "absent" case the drivers must recognise (an unknown cluster prints a line and
``[]`` and exits 0; no serve controller means no services). The first call meets a cold
local API server, so the runner's cold-start retry runs for real. Run by .ci/sky-lane.sh.
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from haru_driver_skypilot import SkyPilotDriver, SkyRunner, SkyTimeouts
from haru_driver_skyserve import SkyServeDriver

pytestmark = [pytest.mark.sky, pytest.mark.slow, pytest.mark.timeout(900)]

MISSING = "haru-live-nonexistent"
# A cold API server takes about 20 s to start on a fast machine; CI machines are slower.
TIMEOUTS = SkyTimeouts(status=300, stop=300, down=300)


@pytest.fixture(scope="module")
def sky_cli(sky: types.ModuleType) -> Iterator[str]:
    """The ``sky`` executable of this environment; the API server it starts is stopped after.

    The ``sky`` fixture gave the session a temp HOME and a private API-server port.
    """
    executable = Path(sys.executable).parent / "sky"
    assert executable.is_file(), f"the sky extra installs {executable}"
    try:
        yield str(executable)
    finally:
        # The API server is a daemon; never leave it running.
        subprocess.run(
            [str(executable), "api", "stop"], check=False, capture_output=True, timeout=120
        )


def runner(sky_cli: str) -> SkyRunner:
    return SkyRunner(executable=sky_cli, retry_delay=5.0)


async def test_cli_unknown_cluster_is_absent(sky_cli: str) -> None:
    driver = SkyPilotDriver(runner(sky_cli), timeouts=TIMEOUTS)
    assert await driver.get_domain_status(MISSING) is None


async def test_cli_stop_and_down_of_an_unknown_cluster_succeed(sky_cli: str) -> None:
    driver = SkyPilotDriver(runner(sky_cli), timeouts=TIMEOUTS)
    await driver.stop_domain(MISSING)
    await driver.teardown_domain(MISSING)


async def test_cli_unknown_service_is_absent(sky_cli: str) -> None:
    driver = SkyServeDriver(runner(sky_cli), timeouts=TIMEOUTS)
    assert await driver.get_service_status(MISSING) is None


async def test_sdk_unknown_cluster_is_absent(sky_cli: str) -> None:
    driver = SkyPilotDriver(status_source="sdk", timeouts=TIMEOUTS)
    assert driver.uses_sdk
    assert await driver.get_domain_status(MISSING) is None


async def test_sdk_without_a_serve_controller_means_no_service(sky_cli: str) -> None:
    driver = SkyServeDriver(status_source="auto", timeouts=TIMEOUTS)
    assert driver.uses_sdk
    assert await driver.get_service_status(MISSING) is None


async def test_preflight_against_the_real_sky(sky_cli: str) -> None:
    info = await SkyPilotDriver(runner(sky_cli), timeouts=TIMEOUTS).preflight()
    assert info.client_version == "0.14.1"
    assert info.server_version == "0.14.1"


async def test_cli_batched_refreshed_status_and_endpoint_of_unknown_clusters(
    sky_cli: str,
) -> None:
    driver = SkyPilotDriver(runner(sky_cli), timeouts=TIMEOUTS)
    names = [MISSING, f"{MISSING}-2"]
    assert await driver.get_domain_statuses(names, refresh=True) == {}
    assert await driver.get_domain_statuses(names) == {}
    assert await driver.get_endpoint(MISSING, 8000) is None  # exit 1: not found


async def test_cli_serve_down_of_an_unknown_service_returns(sky_cli: str) -> None:
    # No serve controller: `sky serve down` exits 1 "No live services.", i.e. nothing left.
    await SkyServeDriver(runner(sky_cli), timeouts=TIMEOUTS).teardown_service(MISSING)
