"""From a provisioned domain of the layout to the SkyPilot task that runs it.

The task's ``setup`` installs the pinned vLLM and haru-supervisor, which carries the serving
gateway (no ``setup`` when the layout says ``install: false``: the image has them); its ``run``
writes the supervisor config (generated from the same slots), starts one vLLM server per model
(dev mode and sleep mode on, the model's served name, 127.0.0.1, its GPU pinned with
``CUDA_VISIBLE_DEVICES``, its memory share, its log file named by its index, never by its
name), the serving gateway ``haru-gateway`` (the only public route to them, behind the serving
credential) and, last, the supervisor. A standby's servers are put to sleep by the reconciler.
The supervisor token, the serving credential and the domain's TLS key and certificate are
SkyPilot secrets: their values never enter the YAML; the supervisor and the gateway serve HTTPS
with that certificate. A SkyServe replica (no supervisor) gets no certificate: its gateway
serves plain HTTP behind SkyServe's load balancer.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

from haru_protocol import (
    InferenceSlotSpec,
    Placement,
    Provisioning,
    SlotSpec,
    SupervisorConfig,
    TrainingSlotSpec,
)

from haru_driver_skypilot._spec import TaskSpec

TOKEN_SECRET = "HARU_SUPERVISOR_TOKEN"  # noqa: S105 -- a variable name, not a value
"""The secret carrying the supervisor token (the name haru-supervisor reads)."""

TLS_CERT_SECRET = "HARU_NODE_TLS_CERT"  # noqa: S105 -- a variable name, not a value
"""The secret carrying the domain's certificate chain (base64 of the PEM, one line)."""

TLS_KEY_SECRET = "HARU_NODE_TLS_KEY"  # noqa: S105 -- a variable name, not a value
"""The secret carrying the domain's private key (base64 of the PEM, one line)."""

TLS_DIR = "$HOME/.haru/tls"
"""Where ``run`` writes the domain's certificate (``node.crt``) and key (``node.key``), mode
0600 in a 0700 directory; the supervisor and the gateway serve HTTPS with them."""

SERVING_TOKEN_SECRET = "HARU_SERVING_TOKEN"  # noqa: S105 -- a variable name, not a value
"""The secret carrying the serving credential (the name haru-gateway reads): the Haru server
presents it on every request it forwards to the gateway."""

STATE_DIR = "$HOME/.haru"
"""Where ``run`` writes the supervisor config and the logs."""


@dataclass(frozen=True, slots=True)
class ModelPort:
    """Where one model of a provisioned domain is served.

    Attributes:
        name: The model's routing name.
        gpu_index: Its GPU.
        port: Its vLLM server's port on 127.0.0.1.
    """

    name: str
    gpu_index: int
    port: int


def model_ports(slots: Sequence[SlotSpec], settings: Provisioning) -> list[ModelPort]:
    """Each model's local vLLM port: ``vllmBasePort`` counted up in layout order."""
    found: list[ModelPort] = []
    for slot in slots:
        if isinstance(slot, InferenceSlotSpec):
            for model in slot.models:
                found.append(
                    ModelPort(model.name, slot.gpu_index, settings.vllm_base_port + len(found))
                )
    return found


def serving_path(model: str) -> str:
    """The gateway path prefix of ``model`` (its serving URL is the gateway's URL + this).

    The name is percent-encoded as one path segment (UTF-8; ``/``, spaces and non-ASCII
    letters included), and the gateway decodes it back.
    """
    return f"/m/{quote(model, safe='')}"


def supervisor_config(slots: Sequence[SlotSpec], settings: Provisioning) -> SupervisorConfig:
    """The supervisor config of a provisioned domain, generated from its slots."""
    ports = {m.name: m.port for m in model_ports(slots, settings)}
    items: list[dict[str, object]] = []
    for slot in slots:
        if isinstance(slot, InferenceSlotSpec):
            items.append(
                {
                    "kind": "inference",
                    "gpuIndex": slot.gpu_index,
                    "models": [{"name": m.name, "port": ports[m.name]} for m in slot.models],
                }
            )
        elif isinstance(slot, TrainingSlotSpec):
            items.append(
                {
                    "kind": "training",
                    "gpuIndex": slot.gpu_index,
                    "command": list(slot.command),
                    "checkpointDir": slot.checkpoint_dir,
                }
            )
    return SupervisorConfig.model_validate({"slots": items})


def _heredoc(path: str, text: str, marker: str) -> list[str]:
    if any(line.strip() == marker for line in text.splitlines()):
        raise ValueError(f"text contains the heredoc marker {marker!r}")
    return [f"cat > {path} <<'{marker}'", *text.splitlines(), marker]


def setup_script(settings: Provisioning) -> str:
    """``setup``: install the pinned vLLM and haru-supervisor (supervisor and gateway), once."""
    packages = [f"vllm=={settings.vllm_version}", settings.supervisor_package]
    return "\n".join(
        [
            "set -euo pipefail",
            f"python3 -m pip install --upgrade {' '.join(shlex.quote(p) for p in packages)}",
        ]
    )


def _tls_files() -> list[str]:
    """Lines that write the TLS secrets to private files and drop them from the environment.

    The values are base64 (one line: a secret is an environment variable). The files are
    written under ``umask 077`` in a subshell (0600 files in a 0700 directory; the rest of the
    script keeps its umask), and the variables are unset, so no child (vLLM, trainers) inherits
    the key.
    """
    missing = "the TLS secrets of the domain are missing"
    return [
        f': "${{{TLS_CERT_SECRET}:?{missing}}}" "${{{TLS_KEY_SECRET}:?{missing}}}"',
        "(",
        "  umask 077",
        f'  mkdir -p "{TLS_DIR}"',
        f'  printf %s "${TLS_CERT_SECRET}" | base64 -d > "{TLS_DIR}/node.crt.tmp"',
        f'  printf %s "${TLS_KEY_SECRET}" | base64 -d > "{TLS_DIR}/node.key.tmp"',
        f'  chmod 600 "{TLS_DIR}/node.crt.tmp" "{TLS_DIR}/node.key.tmp"',
        # Key first: the supervisor reloads when either file changes, and a pair that does not
        # match is refused, so a relaunch on a kept disk never serves a half-written pair.
        f'  mv -f "{TLS_DIR}/node.key.tmp" "{TLS_DIR}/node.key"',
        f'  mv -f "{TLS_DIR}/node.crt.tmp" "{TLS_DIR}/node.crt"',
        ")",
        f"unset {TLS_CERT_SECRET} {TLS_KEY_SECRET}",
    ]


def run_script(
    slots: Sequence[SlotSpec],
    settings: Provisioning,
    *,
    start_asleep: bool,
    supervisor: bool = True,
) -> str:
    """``run``: the domain's processes; the supervisor runs in the foreground last.

    Without ``supervisor`` (a SkyServe replica) no supervisor config is written and the
    gateway runs in the foreground instead. The gateway needs the serving credential (the
    secret :data:`SERVING_TOKEN_SECRET`); the script stops before starting anything without it.
    """
    ports = model_ports(slots, settings)
    lines = [
        "set -euo pipefail",
        # The gateway refuses every request without it: fail before vLLM loads anything.
        f': "${{{SERVING_TOKEN_SECRET}:?the serving credential secret is missing}}"',
        f'HARU_DIR="{STATE_DIR}"',
        'mkdir -p "$HARU_DIR"',
    ]
    if supervisor:
        lines += _tls_files()
    if supervisor:
        config = supervisor_config(slots, settings).model_dump_json(exclude_none=True)
        lines += _heredoc(
            '"$HARU_DIR/supervisor.json"',
            json.dumps(json.loads(config), indent=2),
            "HARU_CONFIG_EOF",
        )
    lines += [
        # vLLM mounts /sleep, /wake_up and /is_sleeping only in dev mode.
        "export VLLM_SERVER_DEV_MODE=1",
        'VLLM="${HARU_VLLM:-vllm}"',
        'GATEWAY="${HARU_GATEWAY:-haru-gateway}"',
    ]
    if supervisor:
        lines.append('SUPERVISOR="${HARU_SUPERVISOR:-haru-supervisor}"')
    port_of = {p.name: p.port for p in ports}
    for slot in slots:
        if not isinstance(slot, InferenceSlotSpec):
            continue
        shares = slot.memory_shares()
        for model in slot.models:
            argv = [
                "serve",
                model.source or model.name,
                "--served-model-name",
                model.name,
                "--host",
                "127.0.0.1",
                "--port",
                str(port_of[model.name]),
                "--enable-sleep-mode",
                "--gpu-memory-utilization",
                f"{shares[model.name]:g}",
                *model.extra_vllm_args,
            ]
            # Named by the model's index: a name may hold "/" or anything else.
            log = f"vllm-{port_of[model.name] - settings.vllm_base_port}.log"
            lines.append(
                f'CUDA_VISIBLE_DEVICES={slot.gpu_index} nohup "$VLLM" '
                f'{" ".join(shlex.quote(a) for a in argv)} > "$HARU_DIR/{log}" 2>&1 &'
            )
    routes = " ".join(f"--route {shlex.quote(f'{p.name}={p.port}')}" for p in ports)
    gateway = (
        f'"$GATEWAY" --listen {settings.gateway_port} --token-env {SERVING_TOKEN_SECRET} {routes}'
    )

    if not supervisor:
        lines.append(f"exec {gateway}")
        return "\n".join(lines)
    # HTTPS with the domain's certificate (the server verifies it against the fleet's CA and
    # the domain's name); only the gateway's environment gets the files' paths.
    tls_env = f'HARU_TLS_CERT_FILE="{TLS_DIR}/node.crt" HARU_TLS_KEY_FILE="{TLS_DIR}/node.key"'
    lines.append(f'{tls_env} nohup {gateway} > "$HARU_DIR/gateway.log" 2>&1 &')
    # A standby's servers start awake too. The reconciler puts them to sleep through the
    # supervisor, which serialises that sleep with every other admin action. A sleep sent
    # from this script could land after a promotion woke the domain (seen in CI), so the
    # script never sends one, whatever ``start_asleep`` says.
    lines += [
        'export HARU_SUPERVISOR_CONFIG="$HARU_DIR/supervisor.json"',
        f"export PORT={settings.supervisor_port}",
        # HTTPS with the certificate the server issued from the fleet's CA (it trusts only
        # that CA and checks the domain's name); re-read by the supervisor when it changes.
        f"export {tls_env}",
        # The token arrives as a SkyPilot secret; the supervisor refuses to run open on 0.0.0.0.
        f': "${{{TOKEN_SECRET}:?the supervisor token secret is missing}}"',
        'exec "$SUPERVISOR"',
    ]
    return "\n".join(lines)


def domain_task(
    name: str,
    placement: Placement,
    slots: Sequence[SlotSpec],
    settings: Provisioning,
    *,
    start_asleep: bool,
    extra_secrets: Sequence[str] = (),
) -> TaskSpec:
    """The SkyPilot task of a provisioned domain.

    Its secrets: the supervisor token, the domain's TLS certificate and key (issued by the
    server from the fleet's CA), and ``extra_secrets`` (a credential the gateway needs).

    Args:
        name: The cluster name (:func:`~haru_driver_skypilot.cluster_name`).
        placement: The domain's placement.
        slots: The domain's slots (layout order).
        settings: The domain's provisioning settings.
        extra_secrets: Names of further secrets the run script reads.
        start_asleep: The domain joins as a standby. Kept for compatibility: the rendered
            task is the same either way, because the reconciler puts a standby's vLLM servers
            to sleep through its supervisor.
    """
    return TaskSpec(
        name=name,
        placement=placement,
        setup=setup_script(settings) if settings.install else None,
        run=run_script(slots, settings, start_asleep=start_asleep),
        ports=(settings.supervisor_port, settings.gateway_port),
        envs={"SKYPILOT_DISABLE_USAGE_COLLECTION": "1"},
        secrets=(
            TOKEN_SECRET,
            SERVING_TOKEN_SECRET,
            TLS_CERT_SECRET,
            TLS_KEY_SECRET,
            *extra_secrets,
        ),
    )
