"""The ``haru demo`` main loop.

:func:`run_demo` runs the topology, the live view, the scenario, and then serves until Ctrl-C
(or ``--duration``), stopping every process it started on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from haru_protocol import (
    load_example_layout,
)
from rich.console import Console
from rich.live import Live

from haru_demo._options import (
    DEFAULT_DEMO_PORT,
    DemoTimings,
    TopologyOptions,
    port_is_free,
)
from haru_demo._procs import DemoError
from haru_demo._scenario import apply_target, run_scenario
from haru_demo._topology import DemoTopology
from haru_demo._traffic import ChatTraffic
from haru_demo._view import FleetWatcher, ViewState, render_view


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoRun:
    """What ``haru demo`` was asked to do."""

    workdir: Path
    port: int = DEFAULT_DEMO_PORT
    scenario: bool = True
    scenario_only: bool = False
    duration_s: float | None = None
    timings: DemoTimings = field(default_factory=DemoTimings)
    clients: int = 4


def snippets(server_url: str, fleet: str, model: str, *, key_file: Path, token_file: Path) -> str:
    """What to try against the running demo: the client key's and admin token's files."""
    return f"""\
Try it (HARU_DEFAULT_FLEET={fleet}, so no X-Haru-Fleet header is needed). Inference takes
the demo's client key, the control API its admin token (each in a file, mode 0600):

  export OPENAI_API_KEY="$(cat {key_file})" HARU_API_TOKEN_FILE={token_file}

  curl -s {server_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -H "Authorization: Bearer $OPENAI_API_KEY" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hello haru"}}]}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{server_url}/v1")  # the key from OPENAI_API_KEY
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "hello haru"}}])
  print(reply.choices[0].message.content)
  EOF

  uv run haru fleet show {fleet} --url {server_url}
  uv run haru keys list --url {server_url}
  uv run haru promote {fleet} alpha --wait --url {server_url}
  uv run haru events {fleet} --follow --url {server_url}
"""


def run_demo(run: DemoRun) -> int:
    """Run the demo; returns the exit status (SIGTERM and Ctrl-C stop it cleanly)."""
    try:
        return asyncio.run(_main(run))
    except KeyboardInterrupt:
        return 130


_SIGNAL_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}
"""Exit status after a stop by each signal (128 + the signal number, as shells report it)."""


async def _main(run: DemoRun) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    stopped_by: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        # SIGTERM and Ctrl-C take the same path: cancel the demo, whose cleanup stops every
        # process it started, then exit with the signal's status. (asyncio.run's own SIGINT
        # handling would re-raise KeyboardInterrupt around the cleanup instead.)
        if stopped_by:
            return
        stopped_by.append(signum)
        # A second Ctrl-C during the cleanup then interrupts at once (the atexit hook still
        # kills the process groups left behind).
        loop.remove_signal_handler(signal.SIGINT)
        if task is not None:
            task.cancel()

    handled: list[signal.Signals] = []
    for signum in _SIGNAL_STATUS:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, on_signal, signum)
            handled.append(signum)
    try:
        return await _demo(run)
    except asyncio.CancelledError:
        if stopped_by:
            return _SIGNAL_STATUS[stopped_by[0]]
        raise
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _demo(run: DemoRun) -> int:
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    port = run.port
    if port and not port_is_free(port):
        err.print(f"port {port} is taken: the server will listen on a free port instead")
        port = 0
    # The server has an admin token; the traffic uses a client key created through the API.
    topology = DemoTopology(
        TopologyOptions(
            workdir=run.workdir,
            server_port=port,
            timings=run.timings,
            api_token=secrets.token_urlsafe(32),
            # The standby's vLLM serves one model more than the layout binds: the apply binds it.
            unbound_models=(apply_target(load_example_layout()),),
        )
    )
    err.print(f"[bold]haru demo[/]: workdir {topology.workdir} (logs in {topology.workdir}/logs)")
    try:
        await topology.start(on_progress=lambda message: err.print(f"  {message}"))
        return await _run_with_view(run, topology, console, err)
    except DemoError as exc:
        err.print(f"[bold red]demo failed:[/] {exc}")
        return 1
    finally:
        err.print("stopping every process the demo started")
        await topology.close()


async def _run_with_view(
    run: DemoRun, topology: DemoTopology, console: Console, err: Console
) -> int:
    fleet = await topology.fleet()
    models = list(dict.fromkeys(m for d in topology.domains.values() for m in d.models))
    state = ViewState(server_url=topology.server_url)
    key = await topology.create_client_key("haru-demo-traffic")
    key_file = topology.secrets_dir / "client.key"
    descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(key + "\n")
    traffic = ChatTraffic(
        topology.server_url, fleet=fleet.slug, models=models, clients=run.clients, api_key=key
    )
    vllm_urls = {
        slug: [server.url for server in domain.vllm.values()]
        for slug, domain in topology.domains.items()
    }
    live: Live | None = None

    def say(text: str) -> None:
        # Above the live view when there is one (it scrolls), else plain lines.
        if live is not None:
            live.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def phase(text: str) -> None:
        state.phase = text
        stamp = f"[{datetime.now(UTC).astimezone():%H:%M:%S}] {text}"
        if live is not None:
            say(stamp)
        else:
            err.print(stamp, markup=False, highlight=False, soft_wrap=True)

    status = 0
    async with topology.control() as control, aiohttp.ClientSession() as session:
        watcher = FleetWatcher(
            state,
            fleet=fleet.slug,
            control=control,
            session=session,
            vllm_urls=vllm_urls,
            traffic=traffic,
        )
        await watcher.poll()
        if console.is_terminal:
            live = Live(render_view(state), console=console, auto_refresh=False)
        refresher: asyncio.Task[None] | None = None
        watcher.start()
        try:
            if live is not None:
                live.start()
                refresher = asyncio.create_task(_refresh(live, state), name="haru-demo-view")
            if run.scenario:
                traffic.start()
                try:
                    report = await run_scenario(topology, traffic, phase=phase)
                finally:
                    await traffic.stop()
                status = 0 if report.ok else 1
                say("\n".join(report.lines()))
            if run.scenario_only:
                phase("scenario finished")
                return status
            phase(f"serving on {topology.server_url} (Ctrl-C to stop)")
            say(
                snippets(
                    topology.server_url,
                    fleet.slug,
                    models[0],
                    key_file=key_file,
                    token_file=topology.api_token_file(),
                )
            )
            if run.duration_s is not None:
                await asyncio.sleep(run.duration_s)
            else:
                await asyncio.Event().wait()
            return status
        finally:
            if refresher is not None:
                refresher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresher
            await watcher.stop()
            if live is not None:
                live.update(render_view(state), refresh=True)
                live.stop()


async def _refresh(live: Live, state: ViewState) -> None:
    while True:
        live.update(render_view(state), refresh=True)
        await asyncio.sleep(0.25)
