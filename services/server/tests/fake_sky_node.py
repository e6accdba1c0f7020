"""A fake ``sky`` whose clusters are this machine: ``launch`` really runs the task's ``run``.

Run as ``python fake_sky_node.py ARGS...`` by a ``sky`` wrapper first on the server's PATH;
it answers the commands Haru uses like SkyPilot 0.14's CLI:

- ``launch -c NAME -y -d [--secret NAME]... TASK.yaml``: reads the rendered task, fails one with
  a ``setup`` (it would install from the network; the layout says ``install: false``: the
  "image" is this machine's virtualenv) and, like SkyPilot after a setup failure
  (``sky/backends/cloud_vm_ray_backend.py``), leaves that cluster UP; otherwise it starts
  ``bash -c <run>`` detached (``-d``), as SkyPilot's job would: in its own session, with the
  task's ``envs``, the secrets taken from its own environment (where the driver put them),
  ``HOME`` = the node's directory (so two clusters on one machine keep their ``~/.haru`` apart) and
  ``PATH`` = the node's ``bin`` (the emulated ``nvidia-smi``), the shims (``vllm`` = the
  emulator) and the virtualenv. The cluster is UP once the job is submitted.
- ``launch`` of a cluster that is still listed does NOT start clean: like SkyPilot
  (``sky/execution.py``: an existing cluster is reused, its job queue runs one job holding
  every GPU at a time) the old processes keep running and the new job stays PENDING (written
  to the node's ``pending-jobs``): a relaunch must ``down`` first.
- ``status N1 N2 ... [--refresh] -o json`` (one call for many clusters, with the
  ``Cluster(s) not found`` line for the unknown ones), ``status --endpoint PORT NAME``
  (127.0.0.1:PORT when UP) and ``status --ip NAME``: exit 1 with ``ValueError ... not
  found`` for an unknown cluster and ``... is not in UP status`` for another status, as
  SkyPilot 0.14.1's ``sky status --ip/--endpoint`` (``sky/client/cli/command.py``).
- ``--version`` and ``api info -o json``: SkyPilot 0.14.1 and a healthy API server (Haru's
  preflight).
- ``down NAME -y``: every process of the node dies, the cluster is gone.
- ``fake-preempt NAME`` (not a SkyPilot command; the test's hand): a spot preemption. Every
  process of the node is SIGKILLed and SkyPilot no longer knows the cluster.
- a ``no-capacity-NAME`` file in the state folder (the test's hand): the next launch of NAME
  fails with SkyPilot's ``ResourcesUnavailableError`` before any machine exists, as a
  relaunch right after a preemption often does; ``setup-fails-NAME``: the next launch fails
  its setup and leaves the cluster UP; ``hang-NAME``: the next launch lists the cluster INIT
  and never returns (killing it leaves the cluster, as killing ``sky launch`` does).

A node's processes are found through ``/proc/<pid>/environ`` (``FAKE_SKY_NODE``), which every
descendant inherits, trainers in their own sessions included: a lost machine loses them all.
Every call is appended to ``calls.jsonl`` in ``$FAKE_SKY_STATE``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

NODE_VAR = "FAKE_SKY_NODE"


def _state() -> Path:
    return Path(os.environ["FAKE_SKY_STATE"])


def node_dir(state: Path, name: str) -> Path:
    """Where the cluster ``name`` lives: ``home/`` (its ``HOME``), ``bin/``, ``run.log``."""
    return state / "nodes" / name


def _cluster_file(state: Path, name: str) -> Path:
    return state / f"cluster-{name}.json"


def _save(state: Path, name: str, cluster: dict[str, Any]) -> None:
    path = _cluster_file(state, name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster))
    os.replace(tmp, path)


def node_pids(node: Path) -> list[int]:
    """Live processes started for ``node`` (their environment names it)."""
    marker = f"{NODE_VAR}={node}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_node(node: Path) -> int:
    """SIGKILL every process of ``node`` (a few passes: a dying parent may have just forked)."""
    killed = 0
    for _ in range(5):
        pids = node_pids(node)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def _launch(state: Path, args: list[str]) -> int:
    name = args[args.index("-c") + 1]
    task = yaml.safe_load(Path(args[-1]).read_text())
    capacity = state / f"no-capacity-{name}"
    if capacity.exists():
        # Right after a spot preemption the region often has no capacity left: the launch
        # fails before any machine exists (sky/exceptions.py ResourcesUnavailableError).
        capacity.unlink()
        sys.stderr.write(
            "sky.exceptions.ResourcesUnavailableError: Failed to provision all possible "
            "launchable resources.\n"
        )
        return 1
    hang = state / f"hang-{name}"
    if hang.exists():
        # The request provisions a machine and never ends; killing this client does not
        # cancel it (sky/client/cli/command.py: "Request will continue running").
        hang.unlink()
        _save(state, name, {"status": "INIT"})
        while True:
            signal.pause()  # until Haru kills the client
    setup_fails = state / f"setup-fails-{name}"
    if task.get("setup") or setup_fails.exists():
        setup_fails.unlink(missing_ok=True)
        _save(state, name, {"status": "UP"})  # kept "for debugging", as SkyPilot does
        sys.stderr.write(
            "fake sky: this task has a `setup` (it would install from the network); "
            "give the domain `install: false`\n"
        )
        return 1
    node = node_dir(state, name)
    home = node / "home"
    home.mkdir(parents=True, exist_ok=True)
    if _cluster_file(state, name).exists():
        # SkyPilot reuses the cluster and queues the job behind the old one, which holds
        # every GPU: the old processes keep running, the new job stays PENDING.
        with (node / "pending-jobs").open("a") as pending:
            pending.write(args[-1] + "\n")
        sys.stdout.write("Job submitted, ID: 2\n")
        return 0
    secrets = [args[i + 1] for i, arg in enumerate(args) if arg == "--secret"]
    env = {k: v for k, v in os.environ.items() if k not in secrets}
    env.update({str(k): str(v) for k, v in (task.get("envs") or {}).items()})
    for secret in secrets:
        env[secret] = os.environ[secret]
    shims = os.environ["FAKE_SKY_SHIMS"]
    env.update(
        HOME=str(home),
        PATH=os.pathsep.join(
            [str(node / "bin"), shims, str(Path(sys.executable).parent), env.get("PATH", "")]
        ),
        **{NODE_VAR: str(node)},
    )
    with (node / "run.log").open("ab") as log:
        subprocess.Popen(
            ["bash", "-c", task["run"]],  # noqa: S607
            cwd=home,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _save(state, name, {"status": "UP"})
    sys.stdout.write("Job submitted, ID: 1\n")
    return 0


def _status(state: Path, args: list[str]) -> int:
    if "--ip" in args or "--endpoint" in args:
        name = args[-1]
        path = _cluster_file(state, name)
        if not path.exists():
            sys.stderr.write(f"ValueError: Cluster {name!r} not found.\n")
            return 1
        if json.loads(path.read_text())["status"] != "UP":
            sys.stderr.write(f"RuntimeError: Cluster {name!r} is not in UP status.\n")
            return 1
        if "--ip" in args:
            sys.stdout.write("127.0.0.1\n")
        else:
            sys.stdout.write(f"127.0.0.1:{args[args.index('--endpoint') + 1]}\n")
        return 0
    names = [arg for arg in args[1:] if not arg.startswith("-") and arg != "json"]
    rows = []
    for name in names:
        path = _cluster_file(state, name)
        if path.exists():
            cluster = json.loads(path.read_text())
            rows.append(
                {
                    "name": name,
                    "status": cluster["status"],
                    "nodes": 1,
                    "autostop": -1,
                    "launched_at": 1764460800,
                }
            )
    missing = [name for name in names if name not in {row["name"] for row in rows}]
    if missing:
        sys.stdout.write(f"Cluster(s) not found: \x1b[1m{', '.join(missing)}\x1b[0m.\n")
    sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    return 0


def _gone(state: Path, name: str) -> int:
    kill_node(node_dir(state, name))
    _cluster_file(state, name).unlink(missing_ok=True)
    return 0


def main(args: list[str]) -> int:
    """The fake CLI; returns the exit status."""
    state = _state()
    with (state / "calls.jsonl").open("a") as calls:
        entry: dict[str, Any] = {"argv": args}
        for arg in args:
            if arg.endswith(".yaml") and os.path.isfile(arg):
                entry["yaml"] = Path(arg).read_text()
        calls.write(json.dumps(entry) + "\n")
    match args[:2]:
        case ["--version"]:
            sys.stdout.write("skypilot, version 0.14.1\n")
            return 0
        case ["api", "info"]:
            server = {"status": "healthy", "version": "0.14.1", "url": "http://127.0.0.1:46580"}
            sys.stdout.write(json.dumps({"client": {"version": "0.14.1"}, "server": server}))
            return 0
    match args[:1]:
        case ["launch"]:
            return _launch(state, args)
        case ["status"]:
            return _status(state, args)
        case ["down"]:
            return _gone(state, args[1])
        case ["fake-preempt"]:
            return _gone(state, args[1])
        case _:
            sys.stderr.write(f"Error: No such command '{args[0] if args else ''}'.\n")
            return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
