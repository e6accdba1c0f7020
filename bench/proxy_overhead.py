"""Inference proxy overhead: direct vs a minimal aiohttp proxy vs Haru (vs nginx, LiteLLM).

Every party runs in its own process on 127.0.0.1:

- upstream: the emulated vLLM server (``python -m haru_sim.vllm``, no time between tokens,
  its default 1 ms frontend latency, ``--tokenize-latency-ms``). Like vLLM, whose streamed
  answer is a StreamingResponse, it sends a stream's headers before generating, so a proxy
  relays them before the first token exists; time to first byte is the first body byte;
- floor: a minimal aiohttp proxy written here (read the body, parse its JSON for ``model``,
  one pooled ``ClientSession``, stream the answer back): what any Python proxy pays; it runs
  on the event loop haru-server runs on (uvloop), so the comparison is of the proxies alone;
- haru: a real ``haru_server`` boot (``run_server``: migrations, app factory, middlewares,
  bearer gate, route lease, proxy) on a SQLite file (and on PostgreSQL with
  ``--postgres-url``) seeded with a one-domain fleet pointing at upstream, logging like
  ``haru-server`` (INFO); it counts the state-store statements it executes (SQLAlchemy
  ``before_cursor_execute``), read by the parent through ``SIGUSR1``;
- nginx: ``nginx`` with a throwaway config (keep-alive upstream pool, no buffering) as a
  reference reverse proxy; skipped when the binary is missing (``apt-get install nginx-light``);
- litellm: ``litellm`` proxy from a separate virtualenv (``--litellm-venv``, or
  ``--install-litellm`` to create one); skipped cleanly when absent;
- with ``--workers 1,2``, ``haru serve`` itself (the CLI, as deployed) with ``HARU_WORKERS``
  set to each value, on SQLite (no statement count for these rows);
- with ``--asyncio``, Haru on SQLite and the floor once more on asyncio's own event loop
  (haru-server runs on uvloop) to show what uvloop changes;
- with ``--tls``, the floor once more as a TLS terminator in front of upstream (the
  emulated vLLM speaks plain HTTP only), and Haru over TLS on both sides: HTTPS to the load
  generator (``HARU_TLS_CERT_FILE``) and an ``https://`` upstream (the terminator), every
  certificate from a throwaway ``trustme`` CA (the proxy verifies the upstream against it
  through ``SSL_CERT_FILE``: it has no serving CA setting yet);
- load: a closed-loop aiohttp client (wrk-style: each of C connections sends its next request
  when the previous answer ended) in a separate process per measurement.

For small non-streamed chat answers at concurrency 1 and 16 it reports p50/p99 latency and
requests per second; for streams at concurrency 1 the time to the first body byte; for Haru the
state-store statements per 1,000 proxied requests during the C=16 run (steady state: the
lease is warm). "Added" columns subtract the direct numbers. One run; numbers are printed, and
the issue's targets are checked against the floor, nothing is asserted.

    uv run python bench/proxy_overhead.py                 # print the table
    uv run python bench/proxy_overhead.py --postgres-url postgresql://postgres@127.0.0.1:5432/db
    uv run python bench/proxy_overhead.py --write-docs    # also update docs/BENCHMARKS.md
    uv run python bench/proxy_overhead.py --tls --no-nginx   # the TLS rows beside clear text
    uv run python bench/proxy_overhead.py --streams-only --streams 1000 --rounds 3
        # time to first byte only, every target in turn, 3 interleaved rounds (on a busy
        # machine prefix `chrt -f 10`: docs/BENCHMARKS.md, *Streaming time to first byte*)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from procs import START_TIMEOUT_S, Processes, free_port, processes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "BENCHMARKS.md"
SECTION = "## Inference proxy against a minimal aiohttp proxy (route lease)"
WRK_SECTION = "## Inference proxy under wrk: the collector's pauses (gc.freeze)"
FLOOR = "floor (minimal aiohttp proxy)"
MODEL = "bench-model"
FLEET = "bench"
TLS_FRONT = "TLS terminator (floor over TLS)"
TLS_HARU = "haru (SQLite, TLS both sides)"
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()
STREAM = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "one two three four five six seven eight"}],
        "stream": True,
    }
).encode()


# -- child process: the Haru server ------------------------------------------------------------


def run_haru(upstream: str, url: str, port: int, *, counter_file: str, mode: str) -> None:
    """Seed the store, then serve Haru as ``haru-server`` does (INFO logging) until SIGTERM."""
    import logging

    import sqlalchemy
    from sqlalchemy import event

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    statements = [0]

    def counted(*_: Any) -> None:
        statements[0] += 1

    # Every engine (the store's async engines wrap sync ones) reports each statement here.
    event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", counted)
    from haru_server._eventloop import run

    if mode == "nofreeze":
        # The before row of the collector change: the start-up heap left to full collections.
        import haru_server._serve

        haru_server._serve.freeze_startup_heap = lambda: None
    # As haru-server runs (uvloop), or on asyncio's own loop for the side-by-side row.
    runner = asyncio.run if mode == "asyncio" else run
    runner(_serve_haru(upstream, url, port, counter_file=counter_file, statements=statements))


async def _serve_haru(
    upstream: str, url: str, port: int, *, counter_file: str, statements: list[int]
) -> None:
    from haru_server._serve import run_server
    from haru_server._settings import Settings

    await seed(upstream, url)
    seq = [0]

    def dump() -> None:
        seq[0] += 1
        partial = Path(f"{counter_file}.partial")
        partial.write_text(f"{seq[0]} {statements[0]}")
        partial.replace(counter_file)  # atomic: the parent never reads half a file

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    tls: dict[str, Any] = {}
    if os.environ.get("BENCH_TLS_CERT"):
        # The TLS row: HTTPS to clients, and an https:// upstream verified against the CA in
        # SSL_CERT_FILE (the proxy's upstream session uses the default trust store).
        tls = {
            "tls_cert_file": Path(os.environ["BENCH_TLS_CERT"]),
            "tls_key_file": Path(os.environ["BENCH_TLS_KEY"]),
        }
    # Settings(...) reads no environment: the connection bounds a bench raises (bench/streams.py:
    # thousands of streams, all from 127.0.0.1) are passed on explicitly.
    bounds = {
        field: int(os.environ[name])
        for field, name in (
            ("http_max_connections", "HARU_HTTP_MAX_CONNECTIONS"),
            ("http_max_connections_per_peer", "HARU_HTTP_MAX_CONNECTIONS_PER_PEER"),
        )
        if name in os.environ
    }
    settings = Settings(
        database_url=url,
        port=port,
        default_fleet=FLEET,
        reconcile_interval_ms=None,
        **tls,
        **bounds,
    )
    await run_server(settings, on_listening=lambda u: print(f"READY {u}", flush=True))


async def seed(upstream: str, url: str) -> None:
    """Migrate ``url`` and apply the one-domain fleet whose model is served by ``upstream``."""
    from haru_db import StateStore, upgrade
    from haru_db.testing import confirm_domains
    from haru_protocol import FleetLayout

    await upgrade(url)
    store = StateStore.open(url)
    try:
        layout = FleetLayout.model_validate(
            {
                "slug": FLEET,
                "activeDomainSlug": "alpha",
                "domains": [
                    {
                        "slug": "alpha",
                        "placement": {
                            "cloud": "aws",
                            "region": "us-east-1",
                            "accelerator": "EXAMPLE-GPU",
                        },
                        "slots": [
                            {
                                "kind": "inference",
                                "gpuIndex": 0,
                                "models": [{"name": MODEL, "servingUrl": upstream}],
                            }
                        ],
                    }
                ],
            }
        )
        result = await store.apply_fleet_layout(layout, at=datetime.now(UTC))
        # What the domain's first good heartbeat does (no supervisor runs in the benchmark).
        await confirm_domains(store, str(result.fleet_id), at=datetime.now(UTC))
    finally:
        await store.close()


# -- child process: the floor proxy -------------------------------------------------------------


async def run_floor(upstream: str, port: int, tls: tuple[str, str] | None = None) -> None:
    """The floor: the least a Python proxy does (no routing state, no checks, no errors).

    With ``tls`` (certificate and key files) it listens with TLS: the TLS rows' upstream, a
    TLS terminator in front of the emulated vLLM (which speaks plain HTTP only).
    """
    import ssl

    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
        auto_decompress=False,
    )

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = json.loads(body)["model"]
        if not isinstance(model, str):
            raise web.HTTPBadRequest
        async with session.post(
            f"{upstream}{request.path}",
            data=body,
            headers={"Content-Type": "application/json", "Accept-Encoding": "identity"},
        ) as upstream_response:
            response = web.StreamResponse(
                status=upstream_response.status,
                headers={"Content-Type": upstream_response.headers.get("Content-Type", "")},
            )
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", proxy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    print(f"READY {'http' if tls is None else 'https'}://127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()
    await session.close()


# -- child process: the load generator ---------------------------------------------------------


async def run_load(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    url: str = spec["url"]
    body = STREAM if spec["stream"] else CHAT
    headers = {"Content-Type": "application/json", **spec.get("headers", {})}
    concurrency: int = spec["concurrency"]
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors: list[str] = []
    import ssl

    cafile = spec.get("cafile")
    trust = ssl.create_default_context(cafile=cafile) if cafile else True
    connector = aiohttp.TCPConnector(limit=concurrency, ssl=trust)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(record: bool) -> None:
            start = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as resp:
                first = await resp.content.readany()
                ttfb = time.perf_counter() - start
                while await resp.content.readany():
                    pass
                elapsed = time.perf_counter() - start
                if resp.status != 200 or not first:
                    errors.append(f"HTTP {resp.status}")
                    return
            if record:
                latencies.append(elapsed)
                ttfbs.append(ttfb)

        async def worker(count: list[int], total: int, deadline: float, record: bool) -> None:
            while count[0] < total and time.perf_counter() < deadline:
                count[0] += 1
                try:
                    await one(record)
                except aiohttp.ClientError as exc:
                    errors.append(type(exc).__name__)

        warm = [0]
        warm_deadline = time.perf_counter() + 10
        await asyncio.gather(
            *(worker(warm, spec["warmup"], warm_deadline, False) for _ in range(concurrency))
        )
        errors.clear()
        done = [0]
        pid = spec.get("pid")
        cpu_before = tree_cpu_seconds(pid) if pid else 0.0
        started = time.perf_counter()
        deadline = started + spec["max_seconds"]
        await asyncio.gather(
            *(worker(done, spec["requests"], deadline, True) for _ in range(concurrency))
        )
        wall = time.perf_counter() - started
        cpu = tree_cpu_seconds(pid) - cpu_before if pid else float("nan")
    return {
        "cpu_us": cpu / len(latencies) * 1e6 if latencies else float("nan"),
        "count": len(latencies),
        "sent": warm[0] + done[0],
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:5],
        "rps": len(latencies) / wall if wall > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "ttfb_p50_ms": percentile(ttfbs, 50) * 1000,
        "ttfb_p99_ms": percentile(ttfbs, 99) * 1000,
    }


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants (Linux ``/proc``)."""
    total = 0.0
    pending = [pid]
    ticks = os.sysconf("SC_CLK_TCK")
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return total


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]


# -- the parent: processes and the table -------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    pid: int | None = None
    """The proxy's process (its children count too), for CPU per request."""
    counter_file: Path | None = None
    """Where a Haru child writes its statement count when sent SIGUSR1."""
    cafile: str | None = None
    """The CA the load generator trusts (a TLS target)."""


def statements(target: Target) -> int | None:
    """The state-store statements the Haru child ``target`` executed so far."""
    if target.counter_file is None or target.pid is None:
        return None
    path = target.counter_file
    before = path.read_text().split()[0] if path.exists() else "0"
    os.kill(target.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists():
            seq, count = path.read_text().split()
            if seq != before:
                return int(count)
        time.sleep(0.01)  # noqa: TID251 - synchronous parent process, no event loop
    raise RuntimeError(f"{target.name} did not report its statement count")


def wait_http(url: str, *, timeout: float = START_TIMEOUT_S) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - a local URL we built
                return
        except OSError:
            time.sleep(0.2)  # noqa: TID251 - synchronous parent process, no event loop
    raise RuntimeError(f"{url} never answered")


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/client_body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream vllm {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 32m;
    location / {{
      proxy_pass http://vllm;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 3600s;
    }}
  }}
}}
"""


def start_nginx(procs: Processes, tmp: Path, upstream_port: int) -> Target | str:
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        return "skipped: nginx not installed (apt-get install -y nginx-light)"
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, upstream_port=upstream_port, port=port))
    child = subprocess.Popen(
        [binary, "-e", str(tmp / "nginx-error.log"), "-p", str(tmp), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs.children.append(child)
    wait_http(f"http://127.0.0.1:{port}/health")
    version = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    name = f"nginx {version.stderr.strip().split('/')[-1]}"
    return Target(name, f"http://127.0.0.1:{port}", {}, child.pid)


def start_tls_rows(procs: Processes, tmp: Path, upstream: str) -> list[Target]:
    """A TLS terminator in front of ``upstream``, and Haru over TLS on both sides to it.

    Compare their *added* columns: the terminator's is what TLS and one Python hop cost, and
    Haru's minus the terminator's is what Haru adds over TLS (against *haru (SQLite)* minus
    *floor* in clear text).
    """
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert, key = tmp / "ca.pem", tmp / "tls.crt", tmp / "tls.key"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    line, pid = procs.start(
        [sys.executable, __file__, "_floor", upstream, str(free_port()), "", str(cert), str(key)],
        ready="READY",
    )
    front = line.split()[-1]
    rows = [Target(TLS_FRONT, front, {}, pid, cafile=str(ca_file))]
    counter = tmp / "statements-tls"
    line, pid = procs.start(
        [
            sys.executable,
            __file__,
            "_haru",
            front,
            f"sqlite:///{tmp / 'tls.db'}",
            str(free_port()),
            str(counter),
            "",
        ],
        ready="READY",
        env={"BENCH_TLS_CERT": str(cert), "BENCH_TLS_KEY": str(key), "SSL_CERT_FILE": str(ca_file)},
    )
    headers = {"X-Haru-Fleet": FLEET}
    rows.append(Target(TLS_HARU, line.split()[-1], headers, pid, counter, cafile=str(ca_file)))
    return rows


def start_haru_workers(procs: Processes, tmp: Path, upstream: str, workers: int) -> Target:
    """``haru serve`` itself with ``HARU_WORKERS=workers`` on a seeded SQLite file."""
    url = f"sqlite:///{tmp / f'workers-{workers}.db'}"
    subprocess.run([sys.executable, __file__, "_seed", upstream, url], check=True, timeout=120)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    # No loop: the seeded domain has no supervisor to heartbeat, and the bench times the proxy.
    env.update(
        DATABASE_URL=url,
        PORT=str(port),
        HARU_DEFAULT_FLEET=FLEET,
        HARU_WORKERS=str(workers),
        HARU_RECONCILE_INTERVAL_MS="off",
    )
    child = subprocess.Popen(
        [sys.executable, "-m", "haru_server", "serve"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    procs.children.append(child)
    wait_http(f"http://127.0.0.1:{port}/healthz")
    time.sleep(2)  # noqa: TID251 - let every worker bind before measuring
    return Target(
        f"haru (SQLite, HARU_WORKERS={workers})",
        f"http://127.0.0.1:{port}",
        {"X-Haru-Fleet": FLEET},
        child.pid,
    )


def litellm_binary(args: argparse.Namespace) -> Path | str:
    venv = Path(args.litellm_venv).expanduser()
    binary = venv / "bin" / "litellm"
    if binary.exists():
        return binary
    if not args.install_litellm:
        return f"skipped: no LiteLLM in {venv} (pass --install-litellm to create it)"
    uv = shutil.which("uv")
    try:
        if uv is not None:
            subprocess.run([uv, "venv", "-q", str(venv)], check=True, timeout=300)
            pip = [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python")]
        else:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "litellm[proxy]"], check=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"skipped: LiteLLM could not be installed ({exc})"
    return binary if binary.exists() else "skipped: LiteLLM installed no litellm command"


def start_litellm(
    procs: Processes, tmp: Path, upstream: str, args: argparse.Namespace
) -> Target | str:
    binary = litellm_binary(args)
    if isinstance(binary, str):
        return binary
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: unused\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    key = f"sk-{secrets.token_hex(32)}"  # LiteLLM refuses to start without a master key
    child = subprocess.Popen(
        [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={
            **os.environ,
            "LITELLM_MASTER_KEY": key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
        },
    )
    procs.children.append(child)
    try:
        wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=120)
    except RuntimeError as exc:
        return f"skipped: LiteLLM did not start ({exc})"
    return Target(
        "litellm", f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}, child.pid
    )


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    def load(*, stream: bool, concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
        spec = {
            "pid": target.pid,
            "url": f"{target.url}/v1/chat/completions",
            "headers": target.headers,
            "stream": stream,
            "concurrency": concurrency,
            "requests": requests,
            "warmup": warmup,
            "max_seconds": args.max_seconds,
            "cafile": target.cafile,
        }
        out = subprocess.run(
            [sys.executable, __file__, "_load", json.dumps(spec)],
            capture_output=True,
            text=True,
            check=True,
            timeout=args.max_seconds + 60,
        )
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    stream = load(stream=True, concurrency=1, requests=args.streams, warmup=50)
    if args.streams_only:
        return {"stream": stream}
    c1 = load(stream=False, concurrency=1, requests=args.c1_requests, warmup=args.warmup)
    before = statements(target)
    c16 = load(stream=False, concurrency=16, requests=args.requests, warmup=args.warmup)
    after = statements(target)
    if before is not None and after is not None:
        c16["statements_per_1000"] = (after - before) / c16["sent"] * 1000
    return {"c1": c1, "c16": c16, "stream": stream}


def stream_rounds(targets: list[Target], args: argparse.Namespace) -> str:
    """Streams only: every target in turn, ``--rounds`` times; p50 TTFB per round and median."""
    ttfb: dict[str, list[float]] = {target.name: [] for target in targets}
    for index in range(args.rounds):
        for target in targets:
            print(f"round {index + 1}: {target.name} ...", file=sys.stderr, flush=True)
            result = measure(target, args)["stream"]
            if result["errors"]:
                print(f"  {result['errors']} errors: {result['error_kinds']}", file=sys.stderr)
            ttfb[target.name].append(result["ttfb_p50_ms"])
    base = statistics.median(ttfb["direct"])
    lines = [
        "| path | stream TTFB p50 ms per round | median | added median ms |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, values in ttfb.items():
        median = statistics.median(values)
        added = "-" if name == "direct" else fmt(median - base)
        rounds = " / ".join(fmt(v) for v in values)
        lines.append(f"| {name} | {rounds} | {fmt(median)} | {added} |")
    return "\n".join(lines) + (
        f"\n\n{args.streams} streams per round at concurrency 1 (after 50 warm-up), "
        f"{args.rounds} rounds interleaved; load average {os.getloadavg()[0]:.1f} at the end."
    )


WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Haru-Fleet"] = "{fleet}"
"""


def _wrk_ms(text: str) -> float:
    """A wrk latency cell (``812.00us``, ``3.41ms``, ``1.02s``) in milliseconds."""
    for unit, scale in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"unexpected wrk latency {text!r}")


def run_wrk(target: Target, script: Path, args: argparse.Namespace) -> dict[str, float]:
    """One closed-loop wrk run against ``target``: req/s, p50, p99 and non-2xx answers."""
    out = subprocess.run(
        [
            shutil.which("wrk") or "wrk",
            "-t1",
            f"-c{args.wrk_connections}",
            f"-d{args.wrk_seconds}s",
            "--latency",
            "-s",
            str(script),
            f"{target.url}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=args.wrk_seconds + 60,
    ).stdout
    result = {"errors": 0.0}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("Requests/sec:"):
            result["rps"] = float(words[1])
        elif len(words) == 2 and words[0] in ("50%", "99%"):
            result[f"p{words[0][:-1]}_ms"] = _wrk_ms(words[1])
        elif line.strip().startswith(("Non-2xx", "Socket errors")):
            result["errors"] += sum(int(w.strip(",")) for w in words if w.strip(",").isdigit())
    return result


def gc_pauses(target: Target) -> dict[str, float] | None:
    """Collections by generation and their pause in all, from a Haru target's /metrics."""
    import urllib.request

    if not target.name.startswith("haru"):
        return None
    with urllib.request.urlopen(f"{target.url}/metrics", timeout=5) as response:  # noqa: S310
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for generation in ("0", "1", "2"):
            label = f'generation="{generation}"'
            if line.startswith("haru_gc_pause_seconds_count{") and label in line:
                found[f"gen{generation}"] = float(line.split()[-1])
            elif line.startswith("haru_gc_pause_seconds_sum{") and label in line:
                found["pause_s"] = found.get("pause_s", 0.0) + float(line.split()[-1])
    return found


def wrk_rounds(targets: list[Target], tmp: Path, args: argparse.Namespace) -> str:
    """wrk against every target in turn, ``--rounds`` times; medians side by side with the floor."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: apt-get install -y wrk")
    script = tmp / "chat.lua"
    script.write_text(WRK_SCRIPT.format(body=json.dumps(CHAT.decode()), fleet=FLEET))
    rows: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    collections: dict[str, dict[str, float]] = {}
    for index in range(args.rounds):
        for target in targets:
            print(f"wrk round {index + 1}: {target.name} ...", file=sys.stderr, flush=True)
            before = gc_pauses(target)
            rows[target.name].append(run_wrk(target, script, args))
            after = gc_pauses(target)
            if before is not None and after is not None:
                total = collections.setdefault(target.name, {})
                for key, value in after.items():
                    total[key] = total.get(key, 0.0) + value - before.get(key, 0.0)
    floor = {k: statistics.median(r[k] for r in rows[FLOOR]) for k in ("rps", "p99_ms")}
    lines = [
        f"| path (wrk -c{args.wrk_connections}) | req/s per round | req/s median "
        "| x floor | p50 ms | p99 ms per round | p99 median | x floor "
        "| gen0/gen1/gen2 collections | collector pause ms | errors |",
        "| --- " + "| ---: " * 10 + "|",
    ]
    for name, results in rows.items():
        rps = statistics.median(r["rps"] for r in results)
        p99 = statistics.median(r["p99_ms"] for r in results)
        p50 = statistics.median(r["p50_ms"] for r in results)
        gc_cells = "- | -"
        if name in collections:
            c = collections[name]
            gc_cells = (
                f"{c.get('gen0', 0):.0f}/{c.get('gen1', 0):.0f}/{c.get('gen2', 0):.0f} "
                f"| {c.get('pause_s', 0) * 1000:.1f}"
            )
        lines.append(
            f"| {name} | {' / '.join(str(round(r['rps'])) for r in results)} | {rps:.0f} "
            f"| {rps / floor['rps']:.2f} | {fmt(p50)} "
            f"| {' / '.join(fmt(r['p99_ms']) for r in results)} | {fmt(p99)} "
            f"| {p99 / floor['p99_ms']:.2f} | {gc_cells} "
            f"| {sum(r['errors'] for r in results):.0f} |"
        )
    checks = []
    for name, results in rows.items():
        if not name.startswith("haru"):
            continue
        rps = statistics.median(r["rps"] for r in results)
        p99 = statistics.median(r["p99_ms"] for r in results)
        checks.append(
            f"- {name}: req/s >= 0.75x floor's: {rps / floor['rps']:.2f}x "
            f"{'met' if rps >= 0.75 * floor['rps'] else 'NOT met'}; p99 <= 2x floor's: "
            f"{p99 / floor['p99_ms']:.2f}x {'met' if p99 <= 2 * floor['p99_ms'] else 'NOT met'}"
        )
    return (
        "\n".join(lines)
        + f"\n\n`wrk -t1 -c{args.wrk_connections} -d{args.wrk_seconds}s --latency`, a POST of "
        f"a small chat body, keep-alive; {args.rounds} rounds interleaved, medians; collections "
        "and their pause summed over the rounds (Haru's `haru_gc_pause_seconds`); load average "
        f"{os.getloadavg()[0]:.1f} at the end.\n\n" + "\n".join(checks)
    )


def fmt(value: float) -> str:
    return f"{value:.2f}"


def table(results: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    base = results["direct"]
    lines = [
        "| path | c1 p50 ms | c1 p99 ms | added c1 p50 ms | c1 req/s | c16 p50 ms | c16 p99 ms "
        "| c16 req/s | proxy CPU us/req (c16) | stream TTFB p50 ms (c1) | added TTFB ms "
        "| store statements / 1000 req | errors |",
        "| --- " + "| ---: " * 12 + "|",
    ]
    for name, result in results.items():
        c1, c16, stream = result["c1"], result["c16"], result["stream"]
        direct = name == "direct"
        errors = c1["errors"] + c16["errors"] + stream["errors"]
        count = c16.get("statements_per_1000")
        cpu = "-" if direct else f"{c16['cpu_us']:.0f}"
        statements_cell = "-" if count is None else f"{count:.1f}"
        lines.append(
            f"| {name} | {fmt(c1['p50_ms'])} | {fmt(c1['p99_ms'])} "
            f"| {'-' if direct else fmt(c1['p50_ms'] - base['c1']['p50_ms'])} "
            f"| {c1['rps']:.0f} | {fmt(c16['p50_ms'])} | {fmt(c16['p99_ms'])} | {c16['rps']:.0f} "
            f"| {cpu} | {fmt(stream['ttfb_p50_ms'])} "
            f"| {'-' if direct else fmt(stream['ttfb_p50_ms'] - base['stream']['ttfb_p50_ms'])} "
            f"| {statements_cell} | {errors} |"
        )
    lines.extend(f"| {name} | {reason} |||||||||||| " for name, reason in skipped.items())
    return "\n".join(lines)


def verdicts(results: dict[str, dict[str, Any]]) -> str:
    """The issue's targets for every Haru row, against the floor measured in the same run."""
    base, floor = results["direct"], results.get(FLOOR)
    if floor is None:
        return ""
    floor_added = floor["c1"]["p50_ms"] - base["c1"]["p50_ms"]
    lines = []
    for name, result in results.items():
        if not name.startswith("haru"):
            continue
        added = result["c1"]["p50_ms"] - base["c1"]["p50_ms"]
        ttfb = result["stream"]["ttfb_p50_ms"] - base["stream"]["ttfb_p50_ms"]
        checks = [
            (
                "added p50 at C=1 <= 2x floor's",
                f"{added:.3f} vs 2 x {floor_added:.3f} ms",
                added <= 2 * floor_added,
            ),
            (
                "req/s at C=16 >= 2/3 of floor's",
                f"{result['c16']['rps']:.0f} vs {floor['c16']['rps'] * 2 / 3:.0f}",
                result["c16"]["rps"] >= floor["c16"]["rps"] * 2 / 3,
            ),
            (
                "p99 at C=16 <= 3x floor's",
                f"{result['c16']['p99_ms']:.2f} vs 3 x {floor['c16']['p99_ms']:.2f} ms",
                result["c16"]["p99_ms"] <= 3 * floor["c16"]["p99_ms"],
            ),
            ("stream TTFB added at C=1 <= 0.3 ms", f"{ttfb:.3f} ms", ttfb <= 0.3),
        ]
        cells = "; ".join(
            f"{what}: {value} {'met' if ok else 'NOT met'}" for what, value, ok in checks
        )
        lines.append(f"- {name}: {cells}")
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> str:
    cpus = os.cpu_count()
    return (
        f"{platform.system()} {platform.machine()}, {cpus} CPU(s), Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end; small "
        f"non-streamed chat answers, closed loop: {args.c1_requests} at concurrency 1 and "
        f"{args.requests} at concurrency 16 (each after {args.warmup} warm-up); {args.streams} "
        "streams at concurrency 1; every server one process, one event loop, except the "
        "HARU_WORKERS rows"
    )


def write_docs(body: str, *, section: str = SECTION) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    start = text.find(section)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    else:
        end = text.find("\n## ", start + len(section))
        text = text[:start] + body + ("\n" + text[end + 1 :] if end >= 0 else "\n")
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text)


@contextlib.contextmanager
def throwaway_postgres(admin_url: str) -> Iterator[str]:
    """A fresh database on the server ``admin_url`` names, dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(admin_url).set(drivername="postgresql")
    name = f"haru_bench_{secrets.token_hex(4)}"
    libpq = admin.render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c1-requests", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=4000, help="requests at concurrency 16")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --streams-only: interleaved rounds"
    )
    parser.add_argument(
        "--tokenize-latency-ms",
        type=float,
        default=1.0,
        help="the emulated vLLM's frontend time before a request is scheduled (its default)",
    )
    parser.add_argument(
        "--first-token-latency-ms",
        type=float,
        default=0.0,
        help="the emulated vLLM's time to the first token once scheduled (prefill)",
    )
    parser.add_argument("--max-seconds", type=float, default=60.0, help="bound per measurement")
    parser.add_argument(
        "--postgres-url",
        help="also run Haru on PostgreSQL: a throwaway database on this server (dropped after)",
    )
    parser.add_argument(
        "--asyncio",
        action="store_true",
        help="also run Haru on SQLite on asyncio's own event loop instead of uvloop",
    )
    parser.add_argument(
        "--workers",
        default="",
        help="comma-separated HARU_WORKERS values: also run `haru serve` with each (SQLite)",
    )
    parser.add_argument("--no-nginx", action="store_true")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="also run a TLS terminator in front of the emulated vLLM and Haru over TLS to it "
        "(trustme certificates)",
    )
    parser.add_argument(
        "--streams-only",
        action="store_true",
        help="measure only the streams' time to first byte (no --write-docs)",
    )
    parser.add_argument(
        "--wrk",
        action="store_true",
        help="measure with wrk (closed loop, C connections) instead of the Python client, "
        "Haru with and without gc.freeze beside the floor; --rounds interleaved rounds",
    )
    parser.add_argument("--wrk-connections", type=int, default=16)
    parser.add_argument("--wrk-seconds", type=int, default=8)
    parser.add_argument("--litellm-venv", default="~/.cache/haru-bench/litellm-venv")
    parser.add_argument("--install-litellm", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.name}")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="haru-bench-")))
        postgres = (
            stack.enter_context(throwaway_postgres(args.postgres_url))
            if args.postgres_url
            else None
        )
        procs = stack.enter_context(processes())  # stopped before the database is dropped
        upstream_port = free_port()
        procs.start(
            [
                sys.executable,
                "-m",
                "haru_sim.vllm",
                "--port",
                str(upstream_port),
                "--served-model-name",
                MODEL,
                "--token-latency-ms",
                "0",
                "--tokenize-latency-ms",
                str(args.tokenize_latency_ms),
                "--first-token-latency-ms",
                str(args.first_token_latency_ms),
            ],
            ready="listening",
        )
        upstream = f"http://127.0.0.1:{upstream_port}"
        targets = [Target("direct", upstream, {})]
        floors = [(FLOOR, "")] + (
            [(f"{FLOOR[:-1]}, asyncio loop)", "asyncio")] if args.asyncio else []
        )
        for name, mode in floors:
            line, pid = procs.start(
                [sys.executable, __file__, "_floor", upstream, str(free_port()), mode],
                ready="READY",
            )
            targets.append(Target(name, line.split()[-1], {}, pid))
        stores = [("haru (SQLite)", f"sqlite:///{tmp / 'haru.db'}", "")]
        if postgres is not None:
            stores.append(("haru (PostgreSQL)", postgres, ""))
        if args.asyncio:
            stores.append(("haru (SQLite, asyncio loop)", f"sqlite:///{tmp / 'a.db'}", "asyncio"))
        if args.wrk:
            stores.append(("haru (SQLite, no gc.freeze)", f"sqlite:///{tmp / 'n.db'}", "nofreeze"))
        for index, (name, database_url, mode) in enumerate(stores):
            counter = tmp / f"statements-{index}"
            line, pid = procs.start(
                [
                    sys.executable,
                    __file__,
                    "_haru",
                    upstream,
                    database_url,
                    str(free_port()),
                    str(counter),
                    mode,
                ],
                ready="READY",
            )
            targets.append(Target(name, line.split()[-1], {"X-Haru-Fleet": FLEET}, pid, counter))
        targets += start_tls_rows(procs, tmp, upstream) if args.tls else []
        counts = [int(w) for w in args.workers.split(",") if w.strip()]
        targets.extend(start_haru_workers(procs, tmp, upstream, n) for n in counts)
        skipped: dict[str, str] = {}
        if not args.no_nginx:
            nginx = start_nginx(procs, tmp, upstream_port)
            if isinstance(nginx, str):
                skipped["nginx"] = nginx
            else:
                targets.append(nginx)
        litellm = start_litellm(procs, tmp, upstream, args)
        if isinstance(litellm, str):
            skipped["litellm"] = litellm
        else:
            targets.append(litellm)

        if args.streams_only:
            print(stream_rounds(targets, args))
            return 0
        if args.wrk:
            rendered = wrk_rounds([t for t in targets if t.name != "direct"], tmp, args)
            print(rendered)
            if args.write_docs:
                command = "uv run python bench/proxy_overhead.py " + " ".join(argv or sys.argv[1:])
                write_docs(
                    f"{WRK_SECTION}\n\nCommand: `{command.strip()}` "
                    f"({datetime.now(UTC):%Y-%m-%d}).\n\n{rendered}\n",
                    section=WRK_SECTION,
                )
            return 0
        results: dict[str, dict[str, Any]] = {}
        for target in targets:
            print(f"measuring {target.name} ...", file=sys.stderr, flush=True)
            results[target.name] = measure(target, args)

    rendered = table(results, skipped)
    checked = verdicts(results)
    print(rendered)
    print(checked)
    print(environment(args))
    if args.write_docs:
        shown = ["<url>" if a == args.postgres_url else a for a in (argv or sys.argv[1:])]
        command = "uv run python bench/proxy_overhead.py " + " ".join(shown)
        write_docs(
            f"{SECTION}\n\n"
            f"Command: `{command.strip()}` ({datetime.now(UTC):%Y-%m-%d}).\n\n"
            f"{environment(args)}.\n\n"
            f"{rendered}\n\n"
            f"Targets of the data-path issue, against the floor of the same run:\n\n{checked}\n\n"
            "How to read it: every run is closed loop (like wrk: C connections, each sends its "
            "next request when the previous answer ended), so *c1* latency is the per-request "
            "cost of the hop and *c16* req/s the throughput of one process. Latency runs from "
            "sending a request to its last body byte; TTFB is the first body byte of a streamed "
            "answer; *added* subtracts the direct numbers. *proxy CPU* is the user + system "
            "CPU of the proxy's process tree per request in the c16 run (aiosqlite's threads "
            "included). The *floor* is the least a Python proxy does: read the body, parse its "
            "JSON for `model`, one pooled `aiohttp.ClientSession`, stream the answer back. "
            "Haru runs as `haru-server` does (uvloop, INFO logging: its access log writes a "
            "line per failed answer only) with its route lease (`HARU_ROUTE_LEASE_MS`=300): no "
            "state-store read per request. *store statements / 1000 req* counts every "
            "statement Haru's engines executed during the c16 run (warm-up included) per "
            "1,000 proxied requests: the lease refresher's pointer reads (one per lease "
            "interval) and a snapshot reload per `HARU_SNAPSHOT_CACHE_TTL_MS`, whatever the "
            "request rate.\n"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_haru":
        run_haru(
            sys.argv[2], sys.argv[3], int(sys.argv[4]), counter_file=sys.argv[5], mode=sys.argv[6]
        )
    elif len(sys.argv) > 1 and sys.argv[1] == "_seed":
        asyncio.run(seed(sys.argv[2], sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_floor":
        from haru_server._eventloop import run

        # On the loop haru-server runs on (uvloop), or on asyncio's own for --asyncio's row.
        tls = (sys.argv[5], sys.argv[6]) if len(sys.argv) > 6 else None
        (asyncio.run if sys.argv[4] == "asyncio" else run)(
            run_floor(sys.argv[2], int(sys.argv[3]), tls)
        )
    elif len(sys.argv) > 1 and sys.argv[1] == "_load":
        print(json.dumps(asyncio.run(run_load(json.loads(sys.argv[2])))))
    else:
        sys.exit(main())
