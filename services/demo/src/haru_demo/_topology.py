"""A whole local fleet as real processes on 127.0.0.1, no GPU, no database server.

:class:`DemoTopology` is the launcher both ``haru demo`` and the end-to-end tests use. It starts,
each as its own process in its own session:

- one emulated vLLM server (``python -m haru_sim.vllm``) per model per domain, shaped like the
  bundled example layout (``example-chat-small`` and ``example-chat-medium`` on GPU 0,
  ``example-chat-large`` on GPU 1); the standby's start asleep (``--start-asleep``);
- one real supervisor (``python -m haru_supervisor``) per domain, whose training slots run the
  emulated trainer and whose GPU memory comes from an emulated ``nvidia-smi``
  (:mod:`haru_sim.nvidia_smi`) first on its ``PATH``;
- the real server (``python -m haru_server serve``) on the embedded SQLite default (a
  ``haru.db`` in the workdir, migrated and seeded with the example layout rewritten with the
  real ports, URLs and checkpoint directories) or on a given ``DATABASE_URL``, with its
  background reconcile loop and autoFailover on, under short demo budgets.

Then it does what an operator would: waits for the first heartbeats and demotes every standby
(``POST /v1/fleets/{ref}/demote``), so the standby reaches standby posture (vLLM asleep,
training running) through the real system. Every file it writes (database, configs, logs,
checkpoints) lives in the workdir. Leaving the context stops every process it started.

The sim and the supervisor run as child processes (haru-demo depends on both): nothing here
imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Final, Self
from uuid import UUID

import aiohttp
from haru_db import StateStore, upgrade
from haru_protocol import (
    AcceptedResponse,
    FleetLayout,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationState,
    TrainingSlotState,
    TrainingStatusResponse,
    bearer_header,
)
from haru_server.control_client import ControlApiError

from haru_demo._options import (
    LOOPBACK,
    DemoDomain,
    VllmServer,
)
from haru_demo._posture import heartbeats_judged
from haru_demo._procs import (
    ChildProcess,
    DemoError,
    kill_stray_trainers,
    reap_orphans,
    spawn,
)
from haru_demo._topology_files import TopologyFiles, _base_env

logger = logging.getLogger(__name__)

_SIM_LISTENING = re.compile(r"^haru-sim-vllm listening on [^\s:]+:(\d+)\s*$", re.MULTILINE)
_SIM_CONTROL = re.compile(r"^haru-sim-vllm control on [^\s:]+:(\d+)\s*$", re.MULTILINE)
_SUPERVISOR_LISTENING = re.compile(r"haru-supervisor listening on http://[^\s:]+:(\d+)")
_SERVER_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")
_POLL_S: Final = 0.1


async def _all(coroutines: Iterable[Coroutine[object, object, object]]) -> None:
    """Run concurrently; on the first failure cancel the rest and raise that failure."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except BaseExceptionGroup as group_error:
        first = group_error.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group_error


class DemoTopology(TopologyFiles):
    """A whole local fleet as separate processes; ``async with DemoTopology(options) as t:``.

    Args:
        options: What to start and where.
    """

    async def create_client_key(self, name: str) -> str:
        """Create an inference client key (``POST /v1/keys``) and return its secret.

        Raises:
            DemoError: The server refused or did not answer.
        """
        try:
            async with self.control() as client:
                created = await client.create_key(name, fleets=[self.fleet_slug])
        except ControlApiError as exc:
            raise DemoError(f"creating the client key {name!r}: {exc}") from exc
        return created.secret

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self, *, on_progress: Callable[[str], None] | None = None) -> None:
        """Start everything, seed the fleet and reach standby posture.

        Raises:
            DemoError: A process did not start, or the fleet did not settle in time.
        """
        progress = on_progress or (lambda _message: None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        active = self.initial_active()
        if self.database_path is not None and self.database_path.exists():
            raise DemoError(
                f"{self.database_path} already exists: the demo seeds a fresh database; "
                "use an empty --workdir"
            )
        await self._migrate()
        self._write_secrets()
        # The server imports the most and starts the slowest: it boots while the rest starts,
        # and its reconcile loop finds the fleet once it is seeded.
        progress("starting the server")
        server_start = asyncio.create_task(self.start_server(), name="haru-demo-server-start")
        try:
            served = sum(len(d.models) + len(d.unbound) for d in self.domains.values())
            progress(f"starting {served} emulated vLLM")
            await _all(
                self._start_vllm(domain, asleep=domain.slug != active)
                for domain in self.domains.values()
            )
            progress("starting the supervisors")
            await _all(self._start_supervisor(domain) for domain in self.domains.values())
            progress("seeding the state store")
            self.layout = self._build_layout()
            (self.workdir / "layout.json").write_text(
                self.layout.model_dump_json(indent=2, exclude_none=True), encoding="utf-8"
            )
            await self._seed(self.layout)
        except BaseException:
            server_start.cancel()
            with contextlib.suppress(BaseException):
                await server_start
            raise
        await server_start
        progress("waiting for the first heartbeats")
        await self.wait_for_fleet(heartbeats_judged, what="every domain to answer a heartbeat")
        if self.options.standby_posture:
            progress("demoting the standby: vLLM asleep, training started")
            await self.ensure_standby_posture()

    async def close(self) -> None:
        """Stop every process (server, supervisors and their trainers, vLLM servers)."""
        if self._closed:
            return
        self._closed = True
        grace = self.timings.stop_grace_s
        if self.server is not None:
            await self.server.stop(grace_s=grace)
        supervisors = [d.supervisor for d in self.domains.values() if d.supervisor is not None]
        # A supervisor stops its trainers first (SIGTERM, then SIGKILL after its own grace).
        supervisor_grace = grace + self.timings.supervisor_shutdown_grace_ms / 1000
        await asyncio.gather(*(s.stop(grace_s=supervisor_grace) for s in supervisors))
        await asyncio.gather(
            *(v.process.stop(grace_s=grace) for d in self.domains.values() for v in d.vllm.values())
        )
        # Anything a failed start left half-way (spawned, never recorded as ready).
        await asyncio.gather(
            *(c.stop(grace_s=self.timings.stop_grace_s) for c in self._children if c.running)
        )
        await reap_orphans()
        strays = kill_stray_trainers(self.checkpoint_root)
        if strays:
            logger.warning("killed %d trainer(s) left behind: %s", len(strays), strays)

    # ---- emulated vLLM servers ---------------------------------------------------------------

    async def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log: str,
        host: str | None = None,
    ) -> ChildProcess:
        if host is not None:
            argv = [*self.placement(host).argv_prefix, *argv]
        child = await spawn(name, argv, env=env, cwd=cwd, log_path=self.workdir / "logs" / log)
        self._children.append(child)
        return child

    async def _spawn_vllm(
        self, domain: DemoDomain, name: str, gpu: int, *, port: int, asleep: bool
    ) -> VllmServer:
        placement = self.placement(domain.slug)
        process = await self._spawn(
            f"vllm-{domain.slug}-{name}",
            self._vllm_argv(name, port=port, asleep=asleep, placed=placement.address != LOOPBACK),
            env=_base_env(),
            cwd=self.workdir,
            log=f"vllm-{domain.slug}-{name}.log",
            host=domain.slug,
        )
        match = await process.wait_for_line(_SIM_LISTENING, timeout_s=self.timings.ready_timeout_s)
        control = await process.wait_for_line(_SIM_CONTROL, timeout_s=self.timings.ready_timeout_s)
        server = VllmServer(
            name=name,
            gpu_index=gpu,
            port=int(match.group(1)),
            process=process,
            address=placement.address,
            control_port=int(control.group(1)),
        )
        domain.vllm[name] = server
        return server

    async def _start_vllm(self, domain: DemoDomain, *, asleep: bool) -> None:
        await _all(
            self._spawn_vllm(domain, name, slot.gpu_index, port=0, asleep=asleep)
            for slot in domain.shape.inference_slots
            for name in domain.served_on(slot.gpu_index)
        )

    async def kill_vllm(self, slug: str) -> datetime:
        """SIGKILL every emulated vLLM server of domain ``slug`` (an unplanned failure).

        Returns:
            When the kill signals were sent.
        """
        servers = list(self.domains[slug].vllm.values())
        at = datetime.now(UTC)
        await asyncio.gather(*(s.process.kill() for s in servers))
        return at

    async def kill_host(self, slug: str) -> datetime:
        """SIGKILL domain ``slug``'s supervisor and every vLLM server at once (a lost host).

        Returns:
            When the kill signals were sent.
        """
        domain = self.domains[slug]
        processes = [s.process for s in domain.vllm.values()]
        if domain.supervisor is not None:
            processes.append(domain.supervisor)
        at = datetime.now(UTC)
        await asyncio.gather(*(p.kill() for p in processes))
        return at

    async def restart_vllm(self, slug: str, *, asleep: bool) -> None:
        """Start domain ``slug``'s vLLM servers again on their ports (after :meth:`kill_vllm`)."""
        domain = self.domains[slug]
        old = list(domain.vllm.values())
        for server in old:
            if server.process.running:
                await server.process.stop(grace_s=self.timings.stop_grace_s)
        await _all(
            self._spawn_vllm(domain, s.name, s.gpu_index, port=s.port, asleep=asleep) for s in old
        )

    # ---- supervisors -------------------------------------------------------------------------

    async def restart_host(self, slug: str) -> None:
        """Bring a lost host back (after :meth:`kill_host`).

        Domain ``slug``'s vLLM servers (asleep) and supervisor start again on their old ports.
        """
        domain = self.domains[slug]
        await self.restart_vllm(slug, asleep=True)
        if domain.supervisor is not None and domain.supervisor.running:
            await domain.supervisor.stop(grace_s=self.timings.stop_grace_s)
        port = int(domain.supervisor_url.rsplit(":", 1)[1]) if domain.supervisor_url else 0
        await self._start_supervisor(domain, port=port)

    async def _start_supervisor(self, domain: DemoDomain, *, port: int = 0) -> None:
        folder = self.workdir / domain.slug
        env = self._supervisor_env(domain, port=port)
        placement = self.placement(domain.slug)
        process = await self._spawn(
            f"supervisor-{domain.slug}",
            [sys.executable, "-m", "haru_supervisor"],
            env=env,
            cwd=folder,
            log=f"supervisor-{domain.slug}.log",
            host=domain.slug,
        )
        domain.supervisor = process
        match = await process.wait_for_line(
            _SUPERVISOR_LISTENING, timeout_s=self.timings.ready_timeout_s
        )
        domain.supervisor_url = f"http://{placement.address}:{match.group(1)}"

    # ---- store -------------------------------------------------------------------------------

    async def _migrate(self) -> None:
        await upgrade(self._store_url)

    async def _seed(self, layout: FleetLayout) -> None:
        store = StateStore.open(self._store_url)
        try:
            result = await store.apply_fleet_layout(layout, at=datetime.now(UTC))
        finally:
            await store.close()
        self.fleet_id = result.fleet_id

    async def start_server(self) -> None:
        """Start the server (again, on the same port and database, after :meth:`stop_server`).

        Raises:
            DemoError: It did not start listening in time.
        """
        if self.server is not None and self.server.running:
            raise DemoError("the server is already running")
        # The embedded default: DATABASE_URL unset, haru.db in the working directory.
        self.server = await self._spawn(
            "server",
            [sys.executable, "-m", "haru_server", "serve"],
            env=self.server_env(),
            cwd=self.workdir,
            log="server.log",
            host="server",
        )
        match = await self.server.wait_for_line(
            _SERVER_LISTENING, timeout_s=self.timings.ready_timeout_s
        )
        self.server_port = int(match.group(1))

    async def stop_server(self, *, kill: bool = False) -> None:
        """Stop the server: SIGKILL (a crash) with ``kill``, else SIGTERM and a grace."""
        if self.server is None:
            return
        if kill:
            await self.server.kill()
        else:
            await self.server.stop(grace_s=self.timings.stop_grace_s)

    # ---- reading and waiting -----------------------------------------------------------------

    async def fleet(self) -> FleetSnapshot:
        """The fleet snapshot from the server."""
        async with self.control() as client:
            return await client.fleet(self.fleet_slug)

    async def wait_for_fleet(
        self,
        predicate: Callable[[FleetSnapshot], bool],
        *,
        what: str,
        timeout_s: float | None = None,
    ) -> FleetSnapshot:
        """Poll the fleet until ``predicate`` holds.

        Raises:
            DemoError: It did not hold within ``timeout_s`` (default: the ready timeout).
        """
        bound = self.timings.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        last_error = ""
        async with self.control() as client:
            while True:
                try:
                    fleet = await client.fleet(self.fleet_slug)
                except ControlApiError as exc:
                    last_error = f" (last error: {exc})"
                else:
                    if predicate(fleet):
                        return fleet
                if time.monotonic() >= deadline:
                    raise DemoError(f"timed out after {bound:.0f}s waiting for {what}{last_error}")
                await asyncio.sleep(_POLL_S)

    async def wait_for_operation(self, operation_id: UUID, *, timeout_s: float) -> Operation:
        """Poll an operation until it ends (succeeded, failed or cancelled).

        Raises:
            DemoError: It was still in flight after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        async with self.control() as client:
            while True:
                with contextlib.suppress(ControlApiError):
                    operation = await client.operation(self.fleet_slug, operation_id)
                    if operation.state not in (OperationState.PENDING, OperationState.RUNNING):
                        return operation
                if time.monotonic() >= deadline:
                    raise DemoError(f"operation {operation_id} still in flight after {timeout_s}s")
                await asyncio.sleep(_POLL_S)

    async def request(self, kind: OperationKind, slug: str) -> Operation | None:
        """Ask for a promote or demote of domain ``slug``.

        Returns:
            The accepted operation, or None when a promote's target is already active.
        """
        async with self.control() as client:
            fleet = await client.fleet(self.fleet_slug)
            target = next(d for d in fleet.domains if d.slug == slug)
            answer = await client.request_operation(self.fleet_slug, kind, target.id)
        return answer.operation if isinstance(answer, AcceptedResponse) else None

    async def ensure_standby_posture(self) -> None:
        """Demote every standby whose training is not running, and wait for each demote.

        Raises:
            DemoError: A demote failed or did not finish in time.
        """
        fleet = await self.fleet()
        for domain in fleet.domains:
            if domain.id == fleet.active_domain_id:
                continue
            training = [s for s in domain.slots if s.training_spec is not None]
            if training and all(s.state is TrainingSlotState.TRAINING for s in training):
                continue
            operation = await self.request(OperationKind.DEMOTE, domain.slug)
            if operation is None:
                continue
            final = await self.wait_for_operation(
                operation.id, timeout_s=self.timings.ready_timeout_s
            )
            if final.state is not OperationState.SUCCEEDED:
                raise DemoError(f"demote of {domain.slug} ended {final.state.value}: {final.error}")

    async def vllm_states(self, slug: str) -> dict[str, dict[str, object] | None]:
        """``GET /_sim/state`` of each of domain ``slug``'s vLLM servers (None: no answer)."""
        domain = self.domains[slug]
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def state(server: VllmServer) -> dict[str, object] | None:
                try:
                    async with session.get(f"{server.url}/_sim/state") as response:
                        body = await response.json()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    return None
                return body if isinstance(body, dict) else None

            servers = list(domain.vllm.values())
            states = await asyncio.gather(*(state(s) for s in servers))
        return {s.name: st for s, st in zip(servers, states, strict=True)}

    async def training_status(self, slug: str) -> TrainingStatusResponse:
        """Domain ``slug``'s supervisor's ``GET /v1/training/status``.

        Raises:
            DemoError: The supervisor did not answer with a status.
        """
        url = f"{self.domains[slug].supervisor_url}/v1/training/status"
        headers = bearer_header(self._supervisor_token_of(slug))
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session,
                session.get(url, headers=headers) as response,
            ):
                raw = await response.read()
                response.raise_for_status()
            return TrainingStatusResponse.model_validate_json(raw)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DemoError(f"training status of {slug}: {exc}") from exc
