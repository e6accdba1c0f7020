"""What a domain's machines run (the launch spec) and the names SkyPilot knows them by."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from haru_protocol import Cloud, Placement, is_slug

from haru_driver_skypilot._errors import InvalidSpecError

MAX_NAME_LENGTH = 63
"""Longest cluster or service name Haru derives (a DNS label)."""

_NAME_PREFIX = "haru"
_HASH_LENGTH = 8
# SkyPilot's own rule is `[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?`; a lowercase DNS label that
# starts with a letter satisfies it and also every cloud's instance naming.
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BAD_REGION_CHARS = re.compile(r"[\s\x00-\x1f\x7f]")


def _check_slugs(fleet: str, domain: str) -> None:
    for kind, value in (("fleet", fleet), ("domain", domain)):
        if not is_slug(value):
            raise InvalidSpecError(f"{kind} slug {value!r} is not a DNS label")


def _cut(name: str, fleet: str, domain: str) -> str:
    if len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(f"{fleet}/{domain}".encode()).hexdigest()[:_HASH_LENGTH]
    head = name[: MAX_NAME_LENGTH - _HASH_LENGTH - 1].rstrip("-")
    return f"{head}-{digest}"


def cluster_name(fleet: str, domain: str) -> str:
    """Derive the SkyPilot cluster (or SkyServe service) name of a domain.

    The name is ``haru-<fleet>--<domain>``. A slug never holds two hyphens in a row, so the
    double hyphen marks where the fleet ends: two (fleet, domain) pairs never share a name
    (``prod-eu``/``alpha`` is ``haru-prod-eu--alpha``, ``prod``/``eu-alpha`` is
    ``haru-prod--eu-alpha``). SkyPilot accepts it (``[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?``,
    ``sky/skylet/constants.py`` ``CLUSTER_NAME_VALID_REGEX``) and so does every cloud's
    instance naming (a DNS label). When the name is longer than :data:`MAX_NAME_LENGTH`,
    it is cut and given a stable 8-character hash of the (fleet, domain) pair, so it stays a
    valid DNS label, never ends with a hyphen, and two long pairs sharing a prefix still get
    different names.

    Args:
        fleet: The fleet slug.
        domain: The domain slug.

    Raises:
        InvalidSpecError: ``fleet`` or ``domain`` is not a slug.
    """
    _check_slugs(fleet, domain)
    return _cut(f"{_NAME_PREFIX}-{fleet}--{domain}", fleet, domain)


def legacy_cluster_name(fleet: str, domain: str) -> str:
    """The name :func:`cluster_name` gave before it was unique: ``haru-<fleet>-<domain>``.

    Two pairs can share it (``prod-eu``/``alpha`` and ``prod``/``eu-alpha``), so it is never
    derived for a new launch; a domain launched under it is found through the name its
    launch recorded.

    Raises:
        InvalidSpecError: ``fleet`` or ``domain`` is not a slug.
    """
    _check_slugs(fleet, domain)
    return _cut(f"{_NAME_PREFIX}-{fleet}-{domain}", fleet, domain)


def is_valid_name(name: str) -> bool:
    """Whether ``name`` is acceptable as a cluster or service name (see :func:`cluster_name`)."""
    return len(name) <= MAX_NAME_LENGTH and _NAME_RE.fullmatch(name) is not None


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid cluster or service name.

    Raises:
        InvalidSpecError: it is not.
    """
    if not is_valid_name(name):
        raise InvalidSpecError(
            f"name {name!r} is not a DNS label starting with a letter (at most "
            f"{MAX_NAME_LENGTH} chars)"
        )
    return name


def _check_placement(placement: Placement) -> None:
    region = placement.region
    # `infra` is `<cloud>/<region>[/<zone>]`: a slash in a cloud region would silently become a
    # zone. Kubernetes "regions" are context names, which may legitimately contain slashes.
    if _BAD_REGION_CHARS.search(region) or (
        placement.cloud is not Cloud.KUBERNETES and "/" in region
    ):
        raise InvalidSpecError(f"region {region!r} cannot be written into `infra`")
    if ":" in placement.accelerator or _BAD_REGION_CHARS.search(placement.accelerator):
        raise InvalidSpecError(
            f"accelerator {placement.accelerator!r} must be a bare SkyPilot accelerator name"
        )


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """Everything :func:`~haru_driver_skypilot.render_task_yaml` needs to describe a domain.

    Attributes:
        name: Cluster name (``sky launch -c``) and the task's ``name:``; for a SkyServe
            service, the service name. Usually from :func:`cluster_name`.
        placement: Cloud, region, accelerator, count and spot choice.
        run: The command that starts the domain's processes (``run:``).
        setup: Optional one-time setup script (``setup:``); omitted when ``None``.
        ports: Ports to open on the machine (``resources.ports``), unique, in order.
        envs: Environment of setup and run. Values are strings because SkyPilot's schema
            only accepts strings.
        secrets: Names of secret variables (``secrets:``, values null). Their values never
            enter the YAML: ``sky launch --secret NAME`` takes each from the environment of
            the ``sky`` process.
    """

    name: str
    placement: Placement
    run: str
    setup: str | None = None
    ports: tuple[int, ...] = ()
    envs: Mapping[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_placement(self.placement)
        if not self.run.strip():
            raise InvalidSpecError("run must not be empty")
        if self.setup is not None and not self.setup.strip():
            raise InvalidSpecError("setup must be None or a non-empty script")
        object.__setattr__(self, "ports", tuple(self.ports))
        # Callers may be untyped (YAML, JSON): check the runtime types, not just the hints.
        ports: tuple[object, ...] = self.ports
        for port in ports:
            if not _is_port(port):
                raise InvalidSpecError(f"port {port!r} is not a TCP port")
        if len(set(self.ports)) != len(self.ports):
            raise InvalidSpecError(f"ports must be unique: {list(self.ports)!r}")
        envs: list[tuple[object, object]] = list(self.envs.items())
        for key, value in envs:
            if not isinstance(key, str) or _ENV_KEY_RE.fullmatch(key) is None:
                raise InvalidSpecError(f"env name {key!r} is not a valid variable name")
            if not isinstance(value, str):
                raise InvalidSpecError(f"env {key!r} must be a string, got {type(value).__name__}")
        object.__setattr__(self, "secrets", tuple(self.secrets))
        names: tuple[object, ...] = self.secrets
        for key in names:
            if not isinstance(key, str) or _ENV_KEY_RE.fullmatch(key) is None:
                raise InvalidSpecError(f"secret name {key!r} is not a valid variable name")
            if key in self.envs:
                raise InvalidSpecError(f"{key!r} is both an env and a secret")
        # A private read-only copy: the caller's dict cannot change a rendered spec later.
        object.__setattr__(self, "envs", MappingProxyType(dict(self.envs)))
