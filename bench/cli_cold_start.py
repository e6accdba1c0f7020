"""Cold start of the ``haru`` CLI, side by side with a bare interpreter.

What it measures: the wall time of fresh processes, each a new interpreter (the operating
system's file cache is warm after the first run, as it is for a user typing commands):

- ``python -c pass``: the floor, the interpreter alone;
- ``python -c "import haru_server.cli"``: building the CLI application;
- ``haru --help``: what a user sees first (the console script of this environment);
- ``haru fleets --help``: a command that only speaks HTTP.

Each command runs ``--runs`` times after one discarded warm-up run; the table gives the median,
the minimum and the maximum in seconds, and the median minus the floor. The target is a
median ``haru --help`` of at most 0.6 s. Also printed: which of SQLAlchemy, Alembic, aiohttp
and the haru state store ``haru --help`` imported (the answer must be none).

Run:  uv run python bench/cli_cold_start.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("sqlalchemy", "alembic", "aiohttp", "haru_db", "haru_demo")


def haru_script() -> list[str]:
    """``haru`` from this virtualenv, else ``python -m haru_server``."""
    script = Path(sys.executable).with_name("haru")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "haru_server"]


def wall_times(argv: list[str], runs: int) -> list[float]:
    env = {**os.environ, "COLUMNS": "100"}
    subprocess.run(argv, capture_output=True, check=True, env=env)  # warm-up, discarded
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, env=env)
        times.append(time.perf_counter() - started)
    return times


def heavy_modules_of_help() -> list[str]:
    probe = (
        "import contextlib, io, sys\n"
        "sys.argv = ['haru', '--help']\n"
        "from haru_server.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main()\n"
        f"print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [name for name in done.stdout.strip().split(",") if name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per command (default 10)")
    args = parser.parse_args()
    haru = haru_script()
    cases = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("import haru_server.cli", [sys.executable, "-c", "import haru_server.cli"]),
        ("haru --help", [*haru, "--help"]),
        ("haru fleets --help", [*haru, "fleets", "--help"]),
    ]
    load = os.getloadavg()[0]
    print(
        f"{args.runs} runs each after one warm-up; {os.cpu_count()} CPUs, load average {load:.1f}"
    )
    print(f"{'command':<24} {'median s':>9} {'min s':>7} {'max s':>7} {'median - floor':>15}")
    floor = None
    for label, argv in cases:
        times = wall_times(argv, args.runs)
        median = statistics.median(times)
        if floor is None:
            floor = median
        print(
            f"{label:<24} {median:>9.3f} {min(times):>7.3f} {max(times):>7.3f} "
            f"{median - floor:>15.3f}"
        )
    heavy = heavy_modules_of_help()
    print(f"heavy modules imported by haru --help: {', '.join(heavy) if heavy else 'none'}")


if __name__ == "__main__":
    main()
