"""Run random fault schedules: ``uv run python tests/faults/run.py --seed N --count M``.

Each schedule ``seed, seed+1, ...`` of each ``--variant`` runs on a fresh fleet; its history
(schedule, faults, pointer moves, operations, invariant checks, traffic) is written to
``<workdir>/<variant>-<seed>/history.txt``. A failing seed is printed with the command that
replays it. Exit status 1 when any invariant was violated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_harness import VARIANTS, make_schedule, run_schedule
from fault_procs import TEMPLATE

_SELF = str(Path(__file__).resolve())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="all")
    parser.add_argument("--faults", type=int, default=8, help="faults per schedule")
    parser.add_argument("--window-s", type=float, default=20.0, help="faults start within this")
    parser.add_argument("--settle-s", type=float, default=45.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep passing schedules' folders")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "HARU_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="PostgreSQL server for pg-replicas (a database per schedule is created there)",
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="the server holds requests during a failover (issue 17): no excuse for failures "
        "while an unplanned failover has no routable active",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="schedules run at once, each in a process of its own (its own event loop, "
        "PostgreSQL forwarder, fleet on ephemeral ports and database); more than the machine's "
        "cores / 4 slows every schedule's processes",
    )
    parser.add_argument(
        "--no-evidence",
        action="store_true",
        help="leave out the evidence faults (partition, lossy link, lost host): the schedules "
        "seeds drew before they existed",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--summary-json", type=Path, default=None)
    return parser


async def _one(
    args: argparse.Namespace, seed: int, variant: str, workdir: Path, gate: asyncio.Semaphore
) -> tuple[dict[str, Any] | None, str | None]:
    """Run one schedule; returns its summary row (None on a harness error) and its failure."""
    async with gate:
        schedule = make_schedule(
            seed,
            variant,
            faults=args.faults,
            window_s=args.window_s,
            evidence=not args.no_evidence,
        )
        folder = workdir / f"{variant}-{seed}"
        started = time.monotonic()
        try:
            result = await run_schedule(
                schedule,
                folder,
                admin_url=args.database_url if variant == "pg-replicas" else None,
                settle_s=args.settle_s,
                hold=args.hold,
            )
        except Exception as exc:  # noqa: BLE001 - a harness failure is reported, not hidden
            print(f"seed={seed} variant={variant} HARNESS ERROR {exc!r} ({folder})", flush=True)
            return None, f"{variant}:{seed}"
        wall = time.monotonic() - started
        print(f"{result.summary()} wall={wall:.1f}s", flush=True)
        row = {
            "seed": seed,
            "variant": variant,
            "violations": result.violations,
            "requests": result.requests,
            "failures": result.failures,
            "excused": result.excused,
            "p50Ms": result.p50_ms,
            "p99Ms": result.p99_ms,
            "operations": result.operations,
            "wallS": round(wall, 1),
            "phasesS": {k: round(v, 1) for k, v in result.phases.items()},
        }
        if result.violations:
            for line in result.violations[:20]:
                print(f"    {line}")
            hold = " --hold" if args.hold else ""
            print(
                f"    replay: uv run python tests/faults/run.py --seed {seed} --count 1 "
                f"--variant {variant} --faults {args.faults} --window-s {args.window_s}{hold}",
                flush=True,
            )
            return row, f"{variant}:{seed}"
        if not args.keep:
            shutil.rmtree(folder / "fleet", ignore_errors=True)
        return row, None


async def _in_child(
    args: argparse.Namespace, seed: int, variant: str, workdir: Path, gate: asyncio.Semaphore
) -> tuple[dict[str, Any] | None, str | None]:
    """Run one schedule in a process of its own (``--jobs``): schedules sharing one event loop
    would stall each other's PostgreSQL forwarder and traffic whenever one of them computes."""
    async with gate:
        summary = workdir / f"{variant}-{seed}.summary.json"
        argv = [
            sys.executable,
            _SELF,
            *("--seed", str(seed), "--count", "1", "--variant", variant),
            *("--faults", str(args.faults), "--window-s", str(args.window_s)),
            *("--settle-s", str(args.settle_s), "--workdir", str(workdir)),
            *("--database-url", args.database_url, "--summary-json", str(summary), "--child"),
            *(["--hold"] if args.hold else []),
            *(["--keep"] if args.keep else []),
            *(["--no-evidence"] if args.no_evidence else []),
        ]
        child = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await child.communicate()
        print(out.decode("utf-8", "replace"), end="", flush=True)
        rows = json.loads(summary.read_text(encoding="utf-8")) if summary.exists() else []
        if not rows:
            print(f"seed={seed} variant={variant} HARNESS ERROR exit {child.returncode}")
            return None, f"{variant}:{seed}"
        return rows[0], (f"{variant}:{seed}" if rows[0]["violations"] else None)


async def _main(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="haru-faults-"))
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    started = time.monotonic()
    gate = asyncio.Semaphore(max(1, args.jobs))
    one = _in_child if args.jobs > 1 else _one
    try:
        outcomes = await asyncio.gather(
            *(
                one(args, seed, variant, workdir, gate)
                for seed in range(args.seed, args.seed + args.count)
                for variant in variants
            )
        )
    finally:
        TEMPLATE.drop()
    rows = [row for row, _ in outcomes if row is not None]
    failed = [failure for _, failure in outcomes if failure is not None]
    total = len(outcomes)
    clean = sum(1 for r in rows if not r["violations"])
    walls = sorted(r["wallS"] for r in rows)
    mean = f", mean {sum(walls) / len(walls):.1f}s per schedule" if walls else ""
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    if args.child:
        return 1 if failed else 0
    print(
        f"\n{total} schedule(s) run, {clean} without violation, {len(failed)} failing: "
        f"{' '.join(failed) or '-'} ({time.monotonic() - started:.0f}s{mean}; "
        f"histories in {workdir})"
    )
    return 1 if failed else 0


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(_main(_parser().parse_args())))


if __name__ == "__main__":
    main()
