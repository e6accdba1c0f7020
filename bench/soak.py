"""Memory soak: ``bench/streams.py``'s streams through Haru and the floor for long, RSS sampled.

The paced SSE upstream, the real Haru server and the floor proxy of ``bench/streams.py``, each
in its own process; rounds of N concurrent streams (default 1,000, 200 tokens at 20 tokens/s)
run back to back against each proxy in turn until ``--minutes`` have passed. After every round
the proxy's RSS is sampled (the streams closed: what the proxy keeps) along with its highest
RSS during the round, the streams cut and the round's transit p99. A proxy whose memory is
flat shows the same after-round RSS from the first minutes to the last; a leak grows with the
number of streams served.

    uv run python bench/soak.py --minutes 30            # the issue's soak
    uv run python bench/soak.py --minutes 10 --write-docs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from streams import DOCS, one_round, processes, raise_nofile, rss_kib, start_targets

SECTION = "## Memory soak under concurrent streams"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--ramp", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--upstream-procs", type=int, default=1)
    parser.add_argument("--targets", default="floor,haru")
    parser.add_argument("--haru-log", default=None, help="append Haru's log to this file")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.name}")
    args = parser.parse_args()
    raise_nofile()
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="haru-soak-") as name, processes() as procs:
        tmp = Path(name)
        targets, _ = start_targets(procs, tmp, args, args.streams)
        proxies = [t for t in targets if t.pid is not None]
        rows = {t.name: [] for t in proxies}
        start_rss = {t.name: rss_kib(t.pid) / 1024 for t in proxies if t.pid}
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            for target in proxies:
                assert target.pid is not None
                result = one_round(target, args.streams, tmp, args)
                after = rss_kib(target.pid) / 1024
                rows[target.name].append(
                    {
                        "minute": (time.monotonic() - started) / 60,
                        "after_mib": after,
                        "peak_mib": result["rss_mib"],
                        "cut": result["cut"],
                        "p99_ms": result["p99_ms"],
                    }
                )
                print(
                    f"{rows[target.name][-1]['minute']:5.1f} min {target.name}: after {after:.1f} "
                    f"MiB, peak {result['rss_mib']:.1f} MiB, cut {result['cut']}",
                    file=sys.stderr,
                    flush=True,
                )
    lines = [
        "| path | RSS idle before MiB | after-round RSS MiB: first 3 rounds | last 3 rounds "
        "| growth MiB (median last 3 - first 3) | peak RSS MiB | rounds | streams cut |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, samples in rows.items():
        first = [s["after_mib"] for s in samples[:3]]
        last = [s["after_mib"] for s in samples[-3:]]
        lines.append(
            f"| {name} | {start_rss[name]:.1f} | {' / '.join(f'{v:.1f}' for v in first)} "
            f"| {' / '.join(f'{v:.1f}' for v in last)} "
            f"| {statistics.median(last) - statistics.median(first):+.1f} "
            f"| {max(s['peak_mib'] for s in samples):.1f} | {len(samples)} "
            f"| {sum(int(s['cut']) for s in samples)} |"
        )
    rendered = "\n".join(lines) + (
        f"\n\n{args.minutes:g} minutes; rounds of {args.streams} streams x {args.tokens} tokens "
        f"at {args.rate:g} tokens/s, the proxies in turn; load average "
        f"{os.getloadavg()[0]:.1f} at the end (`uptime`, {os.cpu_count()} CPUs)."
    )
    print(rendered)
    if args.write_docs:
        command = "uv run python bench/soak.py " + " ".join(sys.argv[1:])
        text = DOCS.read_text()
        body = (
            f"{SECTION}\n\nCommand: `{command.strip()}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)."
            f"\n\n{rendered}\n"
        )
        at = text.find(SECTION)
        if at == -1:
            text = text.rstrip("\n") + "\n\n" + body
        else:
            end = text.find("\n## ", at + len(SECTION))
            text = text[:at] + body + ("" if end == -1 else text[end + 1 :])
        DOCS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
