"""No failover on a blip: one trial of each fault of the flapping suite, on a real network.

The fleet's hosts are network namespaces (the root conftest's ``netlab`` fixture: skipped where
namespaces cannot be made, a failure under CI); ``flapping_lab`` describes the faults, and
``bench/flapping.py`` runs many trials of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from haru_sim.netlab import Lab

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flapping_lab import FAULTS, lab_fleet, run_trial

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
async def test_no_blip_fails_over_and_each_is_visible(netlab: Lab, tmp_path: Path) -> None:
    async with lab_fleet(netlab, tmp_path / "fleet") as fleet:
        trials = [await run_trial(fleet, fault) for fault in FAULTS]
    report = "\n".join(repr(t) for t in trials)
    for trial in trials:
        assert trial.failovers == 0, report
        assert trial.visible, report
        assert trial.settled, report
        assert trial.failed == 0, report
