"""A network lab for tests: hosts as Linux network namespaces on a private bridge.

Real networks fail in ways loopback never does: a host drops off the network (packets vanish,
connections hang instead of being refused), a link loses a fraction of its packets, a path is
slow. This module builds such a network out of kernel pieces so that tests can run Haru's real
processes on it:

- :class:`Lab` makes one bridge in the calling namespace (``ip link add ... type bridge``) with
  an address on a free ``10.231.N.0/24`` subnet, so the test process itself reaches every host;
- :meth:`Lab.host` makes a network namespace (``ip netns add``) joined to the bridge by a veth
  pair (the host's side is called ``eth0``) with the next address of the subnet;
- :meth:`Host.argv` / :meth:`Host.run` / :meth:`Host.popen` run a command inside a namespace
  (``ip netns exec``);
- :meth:`Host.partition` drops every packet on the host's link (or only those to and from one
  peer) with ``iptables -j DROP`` inside the namespace, :meth:`Host.lose` drops a random share
  (``-m statistic --mode random --probability P``), :meth:`Host.heal` removes both;
- :class:`DelayRelay` is a userspace TCP relay (asyncio) that holds every chunk for a fixed
  one-way delay. The kernels these tests run on have no ``netem`` qdisc (``tc qdisc add ...
  netem`` answers "Specified qdisc kind is unknown"), so delay is added in userspace:
  ``DelayRelay(delay_s=0.02)`` between a client and a server makes a 40 ms round trip.
  ``python -m haru_sim.netlab relay LISTEN_HOST:PORT TARGET_HOST:PORT --delay-ms N`` runs one
  as a process (for example inside a namespace, through :meth:`Host.argv`).

Everything a lab makes is removed by :meth:`Lab.close` (also on ``with`` exit and at
interpreter exit): every process inside its namespaces is killed, the namespaces (and with them
their veth ends and iptables rules) and the bridge are deleted. Names carry the creating
process's id, so :func:`sweep` can remove what a killed test run left behind.

Making namespaces needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``), ``ip`` and
``iptables``: :func:`unavailable_reason` says why a lab cannot be made here, or ``None``.
Depends on the standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ipaddress
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = (
    "NETLAB_PREFIX",
    "DelayRelay",
    "Host",
    "Lab",
    "NetlabError",
    "sweep",
    "unavailable_reason",
)

NETLAB_PREFIX = "hnl"
"""Every namespace a lab makes is named ``hnl-<pid>-<lab>-<host>`` (bridge and veth names
start with ``hnb``/``hnv``/``hnw``); :func:`sweep` relies on it."""

_SUBNET_BASE = ipaddress.IPv4Network("10.231.0.0/16")
_labs = itertools.count()
_live: set[Lab] = set()
_live_lock = threading.Lock()


class NetlabError(RuntimeError):
    """A command that builds or changes the lab failed (its argv and stderr are in the text)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise NetlabError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why a :class:`Lab` cannot be made on this machine, or ``None`` when it can.

    Checks the platform, the ``ip`` and ``iptables`` commands, and actually adds (then deletes)
    a namespace, because root inside an unprivileged container may still be refused.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{NETLAB_PREFIX}-{os.getpid()}-probe"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    try:
        listed = _run(["ip", "netns", "exec", probe, "iptables", "-w", "-S"], check=False)
        if listed.returncode != 0:
            return f"iptables inside a namespace failed: {listed.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(eq=False)
class Host:
    """One network namespace on the lab's bridge, with one address (:attr:`address`)."""

    name: str
    netns: str
    address: str
    _rules: list[tuple[str, ...]] = field(default_factory=list, repr=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this namespace (``ip netns exec NETNS ...``).

        ``ip netns exec`` replaces itself with the command, so the pid of the process started
        from this argv is the command's own: signals sent to it reach the command.
        """
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to completion (output captured as text)."""
        return _run(self.argv(argv), check=check)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the namespace; :meth:`Lab.close` kills it if still running."""
        process = subprocess.Popen(self.argv(argv), **kwargs)
        self._procs.append(process)
        return process

    def pids(self) -> list[int]:
        """Every process running inside the namespace (``ip netns pids``)."""
        listed = _ip("netns", "pids", self.netns, check=False)
        return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]

    def partition(self, peer: str | Host | None = None) -> None:
        """Drop every packet on this host's link, in and out (or only to and from ``peer``).

        Connections then hang (no RST, no ICMP), as when a host or its switch port dies;
        :meth:`heal` undoes it.
        """
        self._add_drop(peer, ())

    def lose(self, probability: float, peer: str | Host | None = None) -> None:
        """Drop each packet on this host's link with ``probability`` (0 < p < 1), both ways."""
        if not 0.0 < probability < 1.0:
            raise ValueError(f"probability must be between 0 and 1, got {probability}")
        self._add_drop(
            peer, ("-m", "statistic", "--mode", "random", "--probability", f"{probability:.4f}")
        )

    def heal(self) -> None:
        """Remove every rule :meth:`partition` and :meth:`lose` added."""
        while self._rules:
            rule = self._rules.pop()
            self.run(["iptables", "-w", "-D", *rule])

    def dropped(self) -> int:
        """Packets the rules of :meth:`partition` and :meth:`lose` have dropped so far."""
        listing = self.run(["iptables", "-w", "-L", "-v", "-n", "-x"]).stdout
        return sum(
            int(line.split()[0])
            for line in listing.splitlines()
            if line.split()[2:3] == ["DROP"] and line.split()[0].isdigit()
        )

    @contextlib.contextmanager
    def partitioned(self, peer: str | Host | None = None) -> Iterator[None]:
        """:meth:`partition` for the ``with`` block, then :meth:`heal`."""
        self.partition(peer)
        try:
            yield
        finally:
            self.heal()

    def _add_drop(self, peer: str | Host | None, match: tuple[str, ...]) -> None:
        address = peer.address if isinstance(peer, Host) else peer
        inbound: tuple[str, ...] = ("INPUT", "-i", "eth0")
        outbound: tuple[str, ...] = ("OUTPUT", "-o", "eth0")
        if address is not None:
            inbound, outbound = (*inbound, "-s", address), (*outbound, "-d", address)
        for chain in (inbound, outbound):
            rule = (*chain, *match, "-j", "DROP")
            self.run(["iptables", "-w", "-I", *rule])
            self._rules.append(rule)


class Lab:
    """A bridge with hosts (network namespaces) on a private /24; a context manager.

    ``with Lab() as lab: server = lab.host("server"); ...``. :attr:`gateway` is the bridge's
    own address: the test process (in the calling namespace) reaches every host, and every host
    reaches services the test process binds on :attr:`gateway`.
    """

    def __init__(self) -> None:
        self._index = next(_labs)
        self._tag = f"{os.getpid():x}l{self._index:x}"
        self.bridge = f"{NETLAB_PREFIX[:2]}b{self._tag}"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        self.subnet = self._free_subnet()
        addresses = self.subnet.hosts()
        self.gateway = str(next(addresses))
        self._addresses = addresses
        with _live_lock:
            _live.add(self)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """A new namespace ``hnl-<pid>-<lab>-<name>`` on the bridge, loopback and ``eth0`` up."""
        if self._closed:
            raise NetlabError("the lab is closed")
        if name in self.hosts or not name.replace("-", "").isalnum():
            raise ValueError(f"host name {name!r} is taken or not alphanumeric")
        index = len(self.hosts)
        netns = f"{NETLAB_PREFIX}-{os.getpid()}-{self._index}-{name}"
        inside, outside = f"hnw{self._tag}{index:02x}", f"hnv{self._tag}{index:02x}"
        host = Host(name=name, netns=netns, address=str(next(self._addresses)))
        self.hosts[name] = host
        _ip("netns", "add", netns)
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", netns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", netns, "link", "set", inside, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        """Kill every process in the lab's namespaces, delete them and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for process in host._procs:
                if process.poll() is None:
                    process.kill()
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for process in host._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
                for stream in (process.stdin, process.stdout, process.stderr):
                    if stream is not None:
                        stream.close()
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        with _live_lock:
            _live.discard(self)

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        taken = _ip("-o", "-4", "addr", "show").stdout + _ip("-4", "route", "show").stdout
        candidates = list(_SUBNET_BASE.subnets(new_prefix=24))
        random.shuffle(candidates)
        for subnet in candidates:
            prefix = ".".join(str(subnet.network_address).split(".")[:3]) + "."
            if prefix not in taken:
                return subnet
        raise NetlabError(f"no free /24 left in {_SUBNET_BASE}")


def sweep() -> list[str]:
    """Remove namespaces and links left by labs of processes that no longer run.

    Returns the names removed. Labs of live processes (other test runs) are left alone.
    """
    removed: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        netns = line.split()[0] if line.split() else ""
        parts = netns.split("-")
        if len(parts) < 3 or parts[0] != NETLAB_PREFIX or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        for pid in _ip("netns", "pids", netns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", netns, check=False)
        removed.append(netns)
    # Deleting a namespace deletes its veth pair; only bridges outlive a killed run.
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip() if line.count(":") >= 2 else ""
        owner = name[3:].partition("l")[0]
        if not name.startswith("hnb") or not owner:
            continue
        with contextlib.suppress(ValueError):
            if not _alive(int(owner, 16)):
                _ip("link", "del", name, check=False)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _close_live_labs() -> None:
    with _live_lock:
        labs = list(_live)
    for lab in labs:
        lab.close()


class DelayRelay:
    """A TCP relay that delivers every chunk ``delay_s`` after it arrived, in both directions.

    ``async with DelayRelay(("10.231.7.1", 0), ("10.231.7.3", 8000), delay_s=0.02) as relay:``
    then connect to ``relay.address``. Order is kept; throughput is not limited. ``delay_s``
    may be changed while connections are open (it applies to chunks read afterwards), so a test
    can make one exchange slow. ``connections`` counts the connections accepted so far.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, delay_s: float) -> None:
        self.listen = listen
        self.target = target
        self.delay_s = delay_s
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the relay listens on (the port is known once started)."""
        if self._server is None:
            raise NetlabError("the relay is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self.listen)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                end.close()
            if task is not None:
                self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                try:
                    chunk = await reader.read(65536)
                except OSError:
                    chunk = b""
                queue.put_nowait((loop.time() + self.delay_s, chunk))
                if not chunk:
                    break
            await sender
        except (OSError, asyncio.CancelledError):
            sender.cancel()
            raise


def _split(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


async def _serve_relay(listen: str, target: str, delay_ms: float) -> None:
    relay = DelayRelay(_split(listen), _split(target), delay_s=delay_ms / 1000)
    async with relay:
        host, port = relay.address
        print(f"haru-netlab relay listening on {host}:{port}", flush=True)  # noqa: T201
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m haru_sim.netlab relay LISTEN TARGET --delay-ms N`` or ``... sweep``."""
    parser = argparse.ArgumentParser(prog="python -m haru_sim.netlab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    relay = commands.add_parser("relay", help="a TCP relay with a fixed one-way delay")
    relay.add_argument("listen", help="HOST:PORT to listen on (port 0: any)")
    relay.add_argument("target", help="HOST:PORT to forward to")
    relay.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay (default 20)")
    commands.add_parser("sweep", help="remove what labs of dead processes left behind")
    args = parser.parse_args(argv)
    if args.command == "sweep":
        for name in sweep():
            print(f"removed {name}")  # noqa: T201
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_relay(args.listen, args.target, args.delay_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
