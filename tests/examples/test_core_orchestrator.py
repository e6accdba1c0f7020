"""haru-core's README example: a custom orchestrator run against real supervisors.

The README carries ``packages/core/examples/orchestrator.py`` verbatim (checked here), and the
file runs as a real process against the supervisors of a local fleet (emulated vLLM servers,
real trainers), importing nothing beyond haru-core and haru-supervisor-client (not the supervisor).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import aiohttp
import pytest
from haru_core import PROMOTE_STEPS
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_protocol import SlotKind, TrainingRunState
from haru_supervisor_client import SupervisorClient

pytestmark = pytest.mark.slow

CORE = Path(__file__).resolve().parents[2] / "packages" / "core"
EXAMPLE = CORE / "examples" / "orchestrator.py"
TOKEN = "example-supervisor-token-0123456789"
FORBIDDEN = {
    "haru_server",
    "haru_supervisor",
    "haru_db",
    "haru_demo",
    "haru_sim",
    "sqlalchemy",
    "alembic",
}

_RUN = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
print("MODULES", " ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_the_readme_shows_the_example_verbatim() -> None:
    readme = (CORE / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert EXAMPLE.read_text(encoding="utf-8") in blocks


async def test_the_example_promotes_a_standby_through_the_supervisors(tmp_path: Path) -> None:
    options = LocalFleetOptions(supervisor_token=TOKEN)
    async with LocalFleet(tmp_path / "fleet", options) as fleet:
        layout = tmp_path / "layout.json"
        layout.write_text(fleet.layout().model_dump_json(by_alias=True), encoding="utf-8")
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n", encoding="utf-8")
        token_file.chmod(0o600)
        # The standby trains before the promotion, as a demoted domain does.
        async with aiohttp.ClientSession() as session:
            client = SupervisorClient(session, token=TOKEN)
            await client.start_training(fleet.domain("beta").supervisor_url, timeout_s=10)

        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _RUN,
            str(EXAMPLE),
            str(layout),
            "beta",
            "--token-file",
            str(token_file),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(120):
            out, err = await process.communicate()
        output = out.decode()
        assert process.returncode == 0, output + err.decode()
        for step in PROMOTE_STEPS:
            assert f"done  {step.value}" in output
        lines = output.splitlines()
        assert json.loads(lines[-2]) == {"activeDomainSlug": "beta"}
        modules = set(lines[-1].removeprefix("MODULES ").split())
        assert "haru_core" in modules
        assert "haru_supervisor_client" in modules
        assert modules.isdisjoint(FORBIDDEN), modules & FORBIDDEN

        async with aiohttp.ClientSession() as session:
            client = SupervisorClient(session, token=TOKEN)
            beta = await client.status(fleet.domain("beta").supervisor_url, timeout_s=10)
            alpha = await client.status(fleet.domain("alpha").supervisor_url, timeout_s=10)
        for status, awake in ((beta, True), (alpha, False)):
            models = [
                m for s in status.slots if s.kind is SlotKind.INFERENCE for m in s.models or ()
            ]
            assert models
            assert all(m.sleeping is (not awake) for m in models), status
        assert {s.training.state for s in beta.slots if s.training is not None} == {
            TrainingRunState.IDLE
        }
        assert {s.training.state for s in alpha.slots if s.training is not None} == {
            TrainingRunState.RUNNING
        }
