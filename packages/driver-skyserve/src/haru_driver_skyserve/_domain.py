"""From a ``skyserve`` domain of the layout to the SkyServe service that runs it.

Each replica runs what a ``skypilot`` domain's machine runs, less the supervisor: ``setup``
installs the pinned vLLM and haru-supervisor (for its ``haru-gateway``); ``run`` starts one
vLLM server per model (pinned to its slot's GPU, its memory share, 127.0.0.1) and, in the
foreground, the serving gateway, which is the replica port SkyServe's load balancer targets
(``service.ports``) and requires the serving credential (the SkyPilot secret
``HARU_SERVING_TOKEN``). The readiness probe is the gateway's ``/health``, which needs no
credential and names no model: a replica is READY once every model's server answers. No
replica ever sleeps (a service has no standby posture), so no supervisor and no supervisor
token are needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from haru_driver_skypilot import (
    SERVING_TOKEN_SECRET,
    InvalidSpecError,
    TaskSpec,
    run_script,
    setup_script,
)
from haru_protocol import Placement, Provisioning, SlotSpec

from haru_driver_skyserve._spec import ServiceSpec

READINESS_PATH = "/health"
"""The gateway route SkyServe probes on each replica (200 once every model answers)."""


def domain_service(
    name: str, placement: Placement, slots: Sequence[SlotSpec], settings: Provisioning
) -> ServiceSpec:
    """The SkyServe service of a ``skyserve`` domain.

    Args:
        name: The service name (:func:`~haru_driver_skypilot.cluster_name`).
        placement: Where each replica runs (every replica gets the whole placement).
        slots: The domain's slots (inference only: the layout refuses training slots).
        settings: The domain's provisioning settings (``replicas``, ports, vLLM version).
    """
    task = TaskSpec(
        name=name,
        placement=placement,
        setup=setup_script(settings),
        run=run_script(slots, settings, start_asleep=False, supervisor=False),
        ports=(settings.gateway_port,),
        envs={"SKYPILOT_DISABLE_USAGE_COLLECTION": "1"},
        secrets=(SERVING_TOKEN_SECRET,),
    )
    return ServiceSpec(
        task=task,
        readiness_path=READINESS_PATH,
        initial_delay_seconds=settings.readiness_initial_delay_s,
        replicas=settings.replicas,
        service_port=settings.gateway_port,
    )


def endpoint_url(endpoint: str) -> str:
    """The base URL of a service ``endpoint`` as ``sky serve status`` prints it.

    SkyServe prints ``HOST:PORT`` (``http://`` is meant) or a full ``http(s)://`` URL when
    the load balancer terminates TLS; a trailing slash is dropped.

    Raises:
        InvalidSpecError: ``endpoint`` is neither.
    """
    text = endpoint.strip()
    url = text if "://" in text else f"http://{text}"
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 -- raises on a malformed port
    except ValueError:
        parts = parts._replace(scheme="")
    if parts.scheme not in ("http", "https") or not parts.hostname or " " in text:
        raise InvalidSpecError(f"service endpoint {endpoint!r} is not HOST:PORT or an http(s) URL")
    return url.rstrip("/")
