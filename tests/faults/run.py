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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_harness import VARIANTS, make_schedule, run_schedule


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
    parser.add_argument("--summary-json", type=Path, default=None)
    return parser


async def _main(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="haru-faults-"))
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    failed: list[str] = []
    rows = []
    started = time.monotonic()
    for seed in range(args.seed, args.seed + args.count):
        for variant in variants:
            schedule = make_schedule(seed, variant, faults=args.faults, window_s=args.window_s)
            folder = workdir / f"{variant}-{seed}"
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
                failed.append(f"{variant}:{seed}")
                continue
            print(result.summary(), flush=True)
            rows.append(
                {
                    "seed": seed,
                    "variant": variant,
                    "violations": result.violations,
                    "requests": result.requests,
                    "failures": result.failures,
                    "excused": result.excused,
                    "p50Ms": result.p50_ms,
                    "p99Ms": result.p99_ms,
                    "operations": result.operations,
                }
            )
            if result.violations:
                failed.append(f"{variant}:{seed}")
                for line in result.violations[:20]:
                    print(f"    {line}")
                print(
                    f"    replay: uv run python tests/faults/run.py --seed {seed} --count 1 "
                    f"--variant {variant} --faults {args.faults} --window-s {args.window_s}"
                )
            elif not args.keep:
                shutil.rmtree(folder / "fleet", ignore_errors=True)
    total = len(rows)
    clean = sum(1 for r in rows if not r["violations"])
    print(
        f"\n{total} schedule(s) run, {clean} without violation, {len(failed)} failing: "
        f"{' '.join(failed) or '-'} ({time.monotonic() - started:.0f}s; histories in {workdir})"
    )
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 1 if failed else 0


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(_main(_parser().parse_args())))


if __name__ == "__main__":
    main()
