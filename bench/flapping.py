"""The flapping suite: faults on a real network path that must not fail over, many trials.

Runs the faults of ``tests/flapping/flapping_lab.py`` (a 2 s partition of the active's host,
20 % packet loss on its link for 30 s, one slow heartbeat, a burst of 500s from one model, a
vLLM that refuses connections and is back within ``deadConfirmMs``) round-robin on one fleet
whose hosts are network namespaces (``haru serve``, two supervisors with emulated vLLM servers
and trainers; the default policy with only ``autoFailover`` on), under OpenAI-SDK traffic. Each
trial reports whether the fleet failed over, what made the fault visible, and the traffic's
failures. Needs root (network namespaces, iptables). Nothing is asserted; the exit status is 1
when any trial failed over, was not visible or did not settle.

Run:  uv run python bench/flapping.py [--trials 50] [--loss-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

from haru_sim.netlab import Lab, unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flapping"))

from flapping_lab import FAULTS, Trial, lab_fleet, run_trial


def row(index: int, trial: Trial) -> str:
    return (
        f"| {index} | {trial.fault} | {trial.failovers} | {'yes' if trial.visible else 'NO'} "
        f"| {'yes' if trial.settled else 'NO'} | {trial.requests} | {trial.failed} "
        f"| {trial.evidence} |"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="trials in all (default 50)")
    parser.add_argument("--loss-s", type=float, default=30.0, help="length of the loss fault")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    trials: list[Trial] = []
    print("| # | fault | failovers | visible | settled | requests | failed | evidence |")
    print("|---|---|---|---|---|---|---|---|")
    with Lab() as lab, tempfile.TemporaryDirectory(prefix="haru-bench-flapping-") as workdir:
        async with lab_fleet(lab, Path(workdir) / "fleet") as fleet:
            for index in range(args.trials):
                fault = FAULTS[index % len(FAULTS)]
                trial = await run_trial(fleet, fault, loss_s=args.loss_s)
                trials.append(trial)
                print(row(index, trial), flush=True)
    print()
    print("| fault | trials | failovers | not visible | not settled | requests | failed |")
    print("|---|---|---|---|---|---|---|")
    counts = Counter(t.fault for t in trials)
    for fault in FAULTS:
        mine = [t for t in trials if t.fault == fault]
        print(
            f"| {fault} | {counts[fault]} | {sum(t.failovers for t in mine)} "
            f"| {sum(1 for t in mine if not t.visible)} | {sum(1 for t in mine if not t.settled)} "
            f"| {sum(t.requests for t in mine)} | {sum(t.failed for t in mine)} |"
        )
    bad = [t for t in trials if not t.ok]
    print(f"\n{len(trials)} trials, {sum(t.failovers for t in trials)} failovers, {len(bad)} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
