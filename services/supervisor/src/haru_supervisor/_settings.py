"""Start-up settings: the environment parsed once into a frozen object.

Nothing else in the package reads ``os.environ``; ``__main__`` passes it to
:func:`load_settings`, and tests build :class:`Settings` directly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, get_args

from haru_protocol import SupervisorConfig, normalize_token
from pydantic import ValidationError

from haru_supervisor._errors import SettingsError
from haru_supervisor._users import check_run_as

GpuSource = Literal["auto", "nvml", "nvidia-smi"]
"""Where ``GET /v1/gpu/memory`` reads from: NVML, ``nvidia-smi``, or NVML with a fallback."""

GPU_SOURCES: Final[tuple[GpuSource, ...]] = get_args(GpuSource)

DEFAULT_PORT: Final = 8701
DEFAULT_SHUTDOWN_GRACE_S: Final = 30.0
DEFAULT_STOP_GRACE_S: Final = 30.0

TOKEN_VAR: Final = "HARU_SUPERVISOR_TOKEN"  # noqa: S105  (a variable name, not a secret)
CONFIG_VAR: Final = "HARU_SUPERVISOR_CONFIG"
GPU_SOURCE_VAR: Final = "HARU_SUPERVISOR_GPU_SOURCE"
SHUTDOWN_GRACE_VAR: Final = "HARU_SUPERVISOR_SHUTDOWN_GRACE_MS"
CHECKPOINT_DIR_VAR: Final = "HARU_CHECKPOINT_DIR"
GPU_INDEX_VAR: Final = "HARU_GPU_INDEX"

# Error messages quote at most this much of a bad value or a validation report.
_QUOTE_LIMIT: Final = 2000


def _empty_env() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything the supervisor needs to start.

    Attributes:
        config: The parsed ``HARU_SUPERVISOR_CONFIG`` document.
        port: TCP port to listen on (``PORT``; 0 picks a free one and logs it).
        token: The bearer token every ``/v1/*`` route requires, or None for an open API
            bound to 127.0.0.1 only.
        gpu_source: Which GPU memory source to use (``HARU_SUPERVISOR_GPU_SOURCE``).
        shutdown_grace_s: Grace between SIGTERM and SIGKILL for trainers when the supervisor
            itself shuts down (``HARU_SUPERVISOR_SHUTDOWN_GRACE_MS``).
        stop_grace_s: Grace of ``POST /v1/training/stop`` when the body names none.
        trainer_env: The environment every trainer inherits, secrets already removed;
            ``HARU_CHECKPOINT_DIR`` and ``HARU_GPU_INDEX`` are added per slot.
        search_path: ``PATH`` on which ``nvidia-smi`` is looked up (None: the process's).
    """

    config: SupervisorConfig
    port: int = DEFAULT_PORT
    token: str | None = None
    gpu_source: GpuSource = "auto"
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    trainer_env: Mapping[str, str] = field(default_factory=_empty_env)
    search_path: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", normalize_token(self.token))
        object.__setattr__(
            self, "trainer_env", MappingProxyType(trainer_base_env(self.trainer_env, self.token))
        )

    @property
    def host(self) -> str:
        """All interfaces with a token; loopback only without one (SPEC 6.2)."""
        return "0.0.0.0" if self.token is not None else "127.0.0.1"

    def __repr__(self) -> str:
        # The token never reaches a log line, even through a repr.
        token = "set" if self.token is not None else "unset"
        return (
            f"Settings(port={self.port}, token={token}, gpu_source={self.gpu_source!r}, "
            f"slots={len(self.config.slots)})"
        )


def trainer_base_env(environ: Mapping[str, str], token: str | None) -> dict[str, str]:
    """The parent environment a trainer inherits: the supervisor's secrets removed.

    ``HARU_SUPERVISOR_TOKEN`` goes, and so does any variable whose value IS the token (the
    same secret exported under another name). Only exact matches: a substring test would drop
    ``PATH`` for a token such as ``bin``. The per-slot variables are dropped too: the caller
    sets them.
    """
    secret = normalize_token(token)
    dropped = {TOKEN_VAR, CHECKPOINT_DIR_VAR, GPU_INDEX_VAR}
    return {
        name: value
        for name, value in environ.items()
        if name not in dropped and (secret is None or value.strip() != secret)
    }


def _quote(text: str) -> str:
    return text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "..."


def load_config(value: str) -> SupervisorConfig:
    """Parse ``HARU_SUPERVISOR_CONFIG``: inline JSON (starts with ``{``) or a file path.

    Raises:
        SettingsError: The file cannot be read, is not JSON, or does not validate.
    """
    text = value.strip()
    if not text:
        raise SettingsError(f"{CONFIG_VAR} is required (inline JSON or a path to a JSON file)")
    source = "inline JSON"
    if not text.startswith("{"):
        path = Path(text).expanduser()
        source = f"file {str(path)!r}"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"{CONFIG_VAR}: cannot read {source}: {exc}") from exc
    try:
        json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"{CONFIG_VAR}: {source} is not valid JSON: {exc}") from exc
    try:
        config = SupervisorConfig.model_validate_json(text)
    except ValidationError as exc:
        raise SettingsError(f"{CONFIG_VAR}: {source} is invalid: {_quote(str(exc))}") from exc
    try:
        check_run_as(config)
    except SettingsError as exc:
        raise SettingsError(f"{CONFIG_VAR}: {source}: {exc}") from exc
    return config


def _parse_port(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return DEFAULT_PORT
    text = raw.strip()
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise SettingsError(f"PORT must be an integer from 0 to 65535, got {_quote(text)!r}")
    return int(text)


def _parse_gpu_source(raw: str | None) -> GpuSource:
    text = (raw or "").strip().lower()
    if not text:
        return "auto"
    for source in GPU_SOURCES:
        if text == source:
            return source
    raise SettingsError(
        f"{GPU_SOURCE_VAR} must be one of {', '.join(GPU_SOURCES)}, got {_quote(text)!r}"
    )


def _parse_grace(raw: str | None) -> float:
    if raw is None or not raw.strip():
        return DEFAULT_SHUTDOWN_GRACE_S
    text = raw.strip()
    if not text.isdigit() or int(text) > 2_147_483_647:
        raise SettingsError(
            f"{SHUTDOWN_GRACE_VAR} must be a non-negative integer (milliseconds), "
            f"got {_quote(text)!r}"
        )
    return int(text) / 1000


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Build :class:`Settings` from an environment mapping (``os.environ`` in production).

    Raises:
        SettingsError: A variable is missing or invalid.
    """
    config = load_config(environ.get(CONFIG_VAR, ""))
    return Settings(
        config=config,
        port=_parse_port(environ.get("PORT")),
        token=environ.get(TOKEN_VAR),
        gpu_source=_parse_gpu_source(environ.get(GPU_SOURCE_VAR)),
        shutdown_grace_s=_parse_grace(environ.get(SHUTDOWN_GRACE_VAR)),
        trainer_env=environ,
        search_path=environ.get("PATH"),
    )
