"""Concurrent token streams: N paced SSE streams through Haru's proxy against a floor, one run.

Every party runs in its own process on 127.0.0.1:

- upstream: a paced SSE server written here, shaped like vLLM's streamed chat answer
  (``text/event-stream``, headers first, one ``data: {chat.completion.chunk}`` event per token,
  ``data: [DONE]`` at the end; vLLM's ``serving_chat.py`` ``chat_completion_stream_generator``)
  sending ``--tokens`` tokens per stream at ``--rate`` tokens/s, each stream on its own
  schedule from its own start (``--upstream-procs`` processes share the port with
  SO_REUSEPORT). Each event carries the upstream's ``CLOCK_MONOTONIC`` send time in
  nanoseconds as its first field, ``"t"`` (not a vLLM field; the clients read it);
- targets, each measured in turn: *direct* (the clients talk to the upstream), the *floor*
  (``bench/proxy_overhead.py``'s minimal aiohttp proxy on uvloop: read the body, parse
  ``model``, one pooled ``ClientSession``, relay with ``iter_any``), and *haru*
  (``bench/proxy_overhead.py``'s real ``run_server`` boot as ``haru serve`` runs it: SQLite,
  one confirmed domain, INFO logging, the reconcile loop off, with
  ``HARU_HTTP_MAX_CONNECTIONS`` and ``HARU_HTTP_MAX_CONNECTIONS_PER_PEER`` raised to fit N
  because every client is 127.0.0.1);
- clients: ``--clients`` processes (aiohttp, uvloop), each opening its share of the N
  streams spread evenly over ``--ramp`` seconds, so token times are spread as N streams
  started at different moments are.

Per target and N: the per-token transit delay (client receive time minus the upstream's send
time; the first token of each stream is left out, it carries the request hop), its p50 and
p99, and *added* = the target's percentile minus direct's at the same N; the proxy's process
CPU (user + system, its threads and children included) per 1,000 relayed tokens, from the
first connection to the last stream's end; RSS per open stream = (the proxy's highest RSS
while the streams run - its RSS before the round) / N; streams cut (a stream that ended
without all its tokens and ``[DONE]``, or failed); and the clients' own CPU use, which says
whether the load generator was the bottleneck.

    uv run python bench/streams.py                         # N = 100, 1000, 5000
    uv run python bench/streams.py --streams 1000 --rounds 2 --write-docs

The open-file limit is raised to its hard limit for this process and its children: a proxy
holds two sockets per stream (client and upstream), so N streams need 2N descriptors plus
about 100.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from procs import Processes, free_port, processes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "BENCHMARKS.md"
SECTION = "## Concurrent token streams"
OVERHEAD = ROOT / "bench" / "proxy_overhead.py"
MODEL = "bench-model"
FLEET = "bench"
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "stream": True}
).encode()


def raise_nofile() -> int:
    """Raise this process's (and so its children's) open-file limit to the hard limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` (all its threads) and its live children."""
    sys.path.insert(0, str(OVERHEAD.parent))
    from proxy_overhead import tree_cpu_seconds

    return tree_cpu_seconds(pid)


# -- child process: the paced upstream ---------------------------------------------------------


async def serve_upstream(port: int, tokens: int, rate: float) -> None:
    from aiohttp import web

    interval = 1.0 / rate
    created = int(time.time())
    head = (
        f'"id":"chatcmpl-bench","object":"chat.completion.chunk","created":{created},'
        f'"model":"{MODEL}",'
    )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if body.get("model") != MODEL:
            raise web.HTTPNotFound
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index in range(tokens):
            delay = start + (index + 1) * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.monotonic_ns()
            event = (
                f'data: {{"t":{sent},{head}"choices":[{{"index":0,'
                f'"delta":{{"content":" tok{index}"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
            )
            await response.write(event.encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=8192).start()
    print("READY", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


# -- child process: the clients ----------------------------------------------------------------


async def run_clients(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    count: int = spec["streams"]
    ramp: float = spec["ramp"]
    tokens: int = spec["tokens"]
    delays = array.array("q")
    cut: list[str] = []
    headers = {"Content-Type": "application/json", **spec["headers"]}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    cpu_before = os.times()
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(index: int) -> None:
            await asyncio.sleep(ramp * index / count)
            seen = 0
            done = False
            buffer = b""
            try:
                async with session.post(spec["url"], data=BODY, headers=headers) as resp:
                    if resp.status != 200:
                        cut.append(f"HTTP {resp.status}")
                        return
                    while chunk := await resp.content.readany():
                        now = time.monotonic_ns()
                        buffer += chunk
                        *events, buffer = buffer.split(b"\n\n")
                        for event in events:
                            if event.startswith(b'data: {"t":'):
                                if seen:  # the first token also carries the request hop
                                    sent = int(event[11 : event.index(b",", 11)])
                                    delays.append(now - sent)
                                seen += 1
                            elif event == b"data: [DONE]":
                                done = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                cut.append(type(exc).__name__)
                return
            if seen != tokens or not done:
                cut.append(f"{seen} tokens, done={done}")

        await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - started
    cpu_after = os.times()
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    await asyncio.to_thread(Path(spec["out"]).write_bytes, delays.tobytes())
    return {"cut": len(cut), "cut_kinds": sorted(set(cut))[:5], "cpu": cpu, "wall": wall}


# -- the parent --------------------------------------------------------------------------------


class Target:
    def __init__(self, name: str, url: str, headers: dict[str, str], pid: int | None) -> None:
        self.name = name
        self.url = url
        self.headers = headers
        self.pid = pid


def start_targets(
    procs: Processes, tmp: Path, args: argparse.Namespace, max_streams: int
) -> tuple[list[Target], str]:
    upstream_port = free_port()
    for _ in range(args.upstream_procs):
        procs.start(
            [
                sys.executable,
                __file__,
                "_upstream",
                str(upstream_port),
                str(args.tokens),
                str(args.rate),
            ],
            ready="READY",
        )
    upstream = f"http://127.0.0.1:{upstream_port}"
    targets = [Target("direct", upstream, {}, None)]
    wanted = set(args.targets.split(","))
    if "floor" in wanted:
        port = free_port()
        procs.start(
            [sys.executable, str(OVERHEAD), "_floor", upstream, str(port), ""], ready="READY"
        )
        targets.append(
            Target(
                "floor (minimal aiohttp proxy)",
                f"http://127.0.0.1:{port}",
                {},
                procs.children[-1].pid,
            )
        )
    if "haru" in wanted:
        port = free_port()
        cap = str(max_streams + 256)
        procs.start(
            [
                sys.executable,
                str(OVERHEAD),
                "_haru",
                upstream,
                f"sqlite:///{tmp / 'haru.db'}",
                str(port),
                str(tmp / "statements"),
                "",
            ],
            ready="READY",
            env={"HARU_HTTP_MAX_CONNECTIONS": cap, "HARU_HTTP_MAX_CONNECTIONS_PER_PEER": cap},
            log=None if args.haru_log is None else Path(args.haru_log),
        )
        targets.append(
            Target(
                "haru (SQLite)",
                f"http://127.0.0.1:{port}",
                {"X-Haru-Fleet": FLEET},
                procs.children[-1].pid,
            )
        )
    return targets, upstream


def one_round(target: Target, streams: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    shares = [
        streams // args.clients + (1 if i < streams % args.clients else 0)
        for i in range(args.clients)
    ]
    outs = [tmp / f"delays-{i}" for i in range(args.clients)]
    rss_before = rss_kib(target.pid) if target.pid else 0
    cpu_before = cpu_seconds(target.pid) if target.pid else 0.0
    clients = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "_clients",
                json.dumps(
                    {
                        "url": f"{target.url}/v1/chat/completions",
                        "headers": target.headers,
                        "streams": share,
                        "ramp": args.ramp,
                        "tokens": args.tokens,
                        "out": str(out),
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for share, out in zip(shares, outs, strict=True)
        if share
    ]
    rss_peak = rss_before
    while any(c.poll() is None for c in clients):
        if target.pid:
            rss_peak = max(rss_peak, rss_kib(target.pid))
        time.sleep(0.25)  # noqa: TID251 - synchronous parent process, no event loop
    cpu = cpu_seconds(target.pid) - cpu_before if target.pid else float("nan")
    reports = []
    for client in clients:
        out, _ = client.communicate()
        if client.returncode != 0:
            raise RuntimeError(f"client process failed ({client.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    delays = array.array("q")
    for out in outs:
        if out.exists():
            delays.frombytes(out.read_bytes())
            out.unlink()
    ordered = sorted(delays)
    received = len(ordered) + streams  # the first token of each stream is not in `delays`
    return {
        "p50_ms": ordered[len(ordered) // 2] / 1e6 if ordered else float("nan"),
        "p99_ms": ordered[int(len(ordered) * 0.99)] / 1e6 if ordered else float("nan"),
        "cpu_per_1000": cpu / received * 1000 * 1000 if target.pid else float("nan"),
        "rss_per_stream_kib": (rss_peak - rss_before) / streams if target.pid else float("nan"),
        "rss_mib": rss_peak / 1024 if target.pid else float("nan"),
        "cut": sum(r["cut"] for r in reports),
        "cut_kinds": sorted({k for r in reports for k in r["cut_kinds"]}),
        "client_cpu": max(r["cpu"] / r["wall"] for r in reports),
    }


def fmt(value: float, digits: int = 2) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # NaN -> "-"


def render(results: dict[int, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    lines = [
        "| N | path | transit p50 ms | p99 ms | added p50 ms | added p99 ms | x floor (p99 added) "
        "| proxy CPU ms / 1000 tokens | RSS per stream KiB | proxy RSS MiB | streams cut "
        "| busiest client CPU |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for n, per_target in results.items():

        def med(name: str, key: str, rounds: dict[str, Any] = per_target) -> float:
            return statistics.median(r[key] for r in rounds[name])

        base50, base99 = med("direct", "p50_ms"), med("direct", "p99_ms")
        floor_name = next((t for t in per_target if t.startswith("floor")), None)
        floor_added = med(floor_name, "p99_ms") - base99 if floor_name else float("nan")
        for name, rounds in per_target.items():
            added50 = med(name, "p50_ms") - base50
            added99 = med(name, "p99_ms") - base99
            ratio = added99 / floor_added if floor_added > 0 and name != "direct" else float("nan")
            per_round = " / ".join(fmt(r["p99_ms"]) for r in rounds)
            lines.append(
                f"| {n} | {name} | {fmt(med(name, 'p50_ms'))} | {per_round} "
                f"| {'-' if name == 'direct' else fmt(added50)} "
                f"| {'-' if name == 'direct' else fmt(added99)} | {fmt(ratio)} "
                f"| {fmt(med(name, 'cpu_per_1000'))} | {fmt(med(name, 'rss_per_stream_kib'), 1)} "
                f"| {fmt(med(name, 'rss_mib'), 1)} | {sum(r['cut'] for r in rounds)} "
                f"| {max(r['client_cpu'] for r in rounds):.0%} |"
            )
            if name.startswith("haru") and n == 1000:
                rss = med(name, "rss_per_stream_kib")
                cut = sum(r["cut"] for rs in per_target.values() for r in rs)
                if cut or not floor_added > 0:
                    # Streams cut, or the floor "adding" nothing: the machine, not the proxy,
                    # set the delays; no verdict on the latency goals from such a run.
                    verdicts.append(
                        f"- N=1000: NOT measurable in this run ({cut} streams cut across the "
                        f"paths, direct p99 {fmt(base99)} ms: the machine was saturated); "
                        f"RSS per stream {fmt(rss, 1)} KiB"
                    )
                    continue
                verdicts.append(
                    f"- N=1000: added p99 {fmt(added99)} ms (goal <= 2 ms: "
                    f"{'met' if added99 <= 2 else 'NOT met'}; <= 1.5x the floor's "
                    f"{fmt(floor_added)} ms: {'met' if added99 <= 1.5 * floor_added else 'NOT met'}"
                    f"); RSS per stream {fmt(rss, 1)} KiB (goal <= 30: "
                    f"{'met' if rss <= 30 else 'NOT met'})"
                )
    return "\n".join(lines) + (
        f"\n\n{args.tokens} tokens per stream at {args.rate:g} tokens/s, streams started over "
        f"{args.ramp:g} s, {args.clients} client processes, {args.upstream_procs} upstream "
        f"process(es); {args.rounds} round(s) per target and N, targets interleaved, medians "
        f"(p99 per round shown); load average {os.getloadavg()[0]:.1f} at the end "
        f"(`uptime`, {os.cpu_count()} CPUs).\n\n" + "\n".join(verdicts)
    )


def write_docs(body: str) -> None:
    text = DOCS.read_text()
    start = text.find(SECTION)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + ("" if end == -1 else text[end + 1 :])
    DOCS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="100,1000,5000", help="N values, comma-separated")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--ramp", type=float, default=2.0, help="seconds to open all streams")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--upstream-procs", type=int, default=1)
    parser.add_argument("--targets", default="floor,haru", help="besides direct")
    parser.add_argument("--haru-log", default=None, help="append Haru's log to this file")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.name}")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    limit = raise_nofile()
    if limit < 2 * max(counts) + 200:
        print(f"open-file hard limit {limit} is below 2N + 200", file=sys.stderr)
        return 2
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="haru-streams-") as name, processes() as procs:
        tmp = Path(name)
        targets, _ = start_targets(procs, tmp, args, max(counts))
        for target in targets[1:]:  # warm each proxy's paths and pools once
            one_round(target, 20, tmp, argparse.Namespace(**{**vars(args), "ramp": 0.2}))
        for n in counts:
            results[n] = {t.name: [] for t in targets}
            for index in range(args.rounds):
                for target in targets:
                    print(
                        f"N={n} round {index + 1}: {target.name} ...", file=sys.stderr, flush=True
                    )
                    result = one_round(target, n, tmp, args)
                    if result["cut"]:
                        print(f"  {result['cut']} cut: {result['cut_kinds']}", file=sys.stderr)
                    results[n][target.name].append(result)
    rendered = render(results, args)
    print(rendered)
    if args.write_docs:
        command = "uv run python bench/streams.py " + " ".join(argv or sys.argv[1:])
        write_docs(
            f"{SECTION}\n\nCommand: `{command.strip()}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)."
            f"\n\n{rendered}\n"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        from haru_server._eventloop import run

        run(serve_upstream(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    elif len(sys.argv) > 1 and sys.argv[1] == "_clients":
        from haru_server._eventloop import run

        print(json.dumps(run(run_clients(json.loads(sys.argv[2])))))
    else:
        sys.exit(main())
