"""Start-up settings: the environment parsed once into a frozen object.

Nothing else in the package reads ``os.environ``; ``__main__`` passes it to
:func:`load_settings`, and tests build :class:`Settings` directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Final, Literal, get_args

from haru_protocol import SupervisorConfig, normalize_token
from haru_web import (
    EnvInt,
    EnvSettingsError,
    FileToken,
    ListenerSettings,
    TokenSource,
    token_validator,
)
from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from haru_supervisor._errors import SettingsError
from haru_supervisor._users import check_run_as

GpuSource = Literal["auto", "nvml", "nvidia-smi"]
"""Where ``GET /v1/gpu/memory`` reads from: NVML, ``nvidia-smi``, or NVML with a fallback."""

GPU_SOURCES: Final[tuple[GpuSource, ...]] = get_args(GpuSource)

DEFAULT_PORT: Final = 8701
DEFAULT_SHUTDOWN_GRACE_S: Final = 30.0
DEFAULT_STOP_GRACE_S: Final = 30.0

TOKEN_VAR: Final = "HARU_SUPERVISOR_TOKEN"  # noqa: S105  (a variable name, not a secret)
TOKEN_FILE_VAR: Final = "HARU_SUPERVISOR_TOKEN_FILE"  # noqa: S105
TOKEN_OVERLAP_VAR: Final = "HARU_SUPERVISOR_TOKEN_OVERLAP_MS"  # noqa: S105
DEFAULT_TOKEN_OVERLAP_MS: Final = 300_000
CONFIG_VAR: Final = "HARU_SUPERVISOR_CONFIG"
GPU_SOURCE_VAR: Final = "HARU_SUPERVISOR_GPU_SOURCE"
SHUTDOWN_GRACE_VAR: Final = "HARU_SUPERVISOR_SHUTDOWN_GRACE_MS"
CHECKPOINT_DIR_VAR: Final = "HARU_CHECKPOINT_DIR"
GPU_INDEX_VAR: Final = "HARU_GPU_INDEX"

TOKEN: Final = FileToken(TOKEN_VAR, "token", "token_file")

_MESSAGES: Final = {"PORT": "must be an integer from 0 to 65535"}
"""What a boot error says of a variable instead of pydantic's words."""

# Error messages quote at most this much of a bad value or a validation report.
_QUOTE_LIMIT: Final = 2000


def _empty_env() -> Mapping[str, str]:
    return MappingProxyType({})


def _no_keys() -> Mapping[str, SecretStr]:
    return MappingProxyType({})


def _gpu_source(value: object) -> object:
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text not in GPU_SOURCES:
        raise ValueError(f"must be one of {', '.join(GPU_SOURCES)}, got {_quote(text)!r}")
    return text


class Settings(ListenerSettings):
    """Everything the supervisor needs to start (README: "Configuration").

    :func:`load_settings` reads an environment mapping through pydantic-settings; building
    :class:`Settings` directly reads nothing from the environment. Frozen; the token is a
    ``SecretStr`` of at least 16 characters and never appears in a repr or a dump. The
    listener's fields (``HARU_HOST``, ``HARU_HTTP_*``, ``HARU_LOG_*``, ``HARU_TLS_*``, ...) are
    :class:`haru_web.ListenerSettings`; the rest are the supervisor's own.
    """

    model_config = SettingsConfigDict(arbitrary_types_allowed=True)
    guard_token = TOKEN
    file_tokens = (TOKEN,)

    config: SupervisorConfig
    """The parsed ``HARU_SUPERVISOR_CONFIG`` document."""
    port: Annotated[EnvInt, Field(ge=0, le=65535)] = Field(
        DEFAULT_PORT, validation_alias=AliasChoices("port", "PORT")
    )
    """``PORT``: TCP port to listen on (0 picks a free one and logs it)."""
    token: Annotated[SecretStr | None, token_validator(TOKEN_VAR)] = Field(
        None, validation_alias=AliasChoices("token", TOKEN_VAR)
    )
    """``HARU_SUPERVISOR_TOKEN`` (or ``HARU_SUPERVISOR_TOKEN_FILE``): the bearer token of every
    ``/v1/*`` route; None = open API on 127.0.0.1 only, browsers kept out."""
    token_file: Path | None = Field(
        None, validation_alias=AliasChoices("token_file", TOKEN_FILE_VAR)
    )
    """``HARU_SUPERVISOR_TOKEN_FILE``: the file :attr:`token` was read from; re-read when it
    changes (a rotation without a restart)."""
    token_overlap_ms: Annotated[EnvInt, Field(ge=0, le=2_147_483_647)] = Field(
        DEFAULT_TOKEN_OVERLAP_MS,
        validation_alias=AliasChoices("token_overlap_ms", TOKEN_OVERLAP_VAR),
    )
    """``HARU_SUPERVISOR_TOKEN_OVERLAP_MS``: after the token file changes, the previous token is
    still accepted this long (the servers' files are changed second); 0: at once refused."""
    gpu_source: Annotated[GpuSource, BeforeValidator(_gpu_source)] = Field(
        "auto", validation_alias=AliasChoices("gpu_source", GPU_SOURCE_VAR)
    )
    """``HARU_SUPERVISOR_GPU_SOURCE``: NVML, ``nvidia-smi``, or NVML with a fallback (any case;
    blank: ``auto``)."""
    shutdown_grace_ms: Annotated[EnvInt, Field(ge=0, le=2_147_483_647)] = Field(
        round(DEFAULT_SHUTDOWN_GRACE_S * 1000),
        validation_alias=AliasChoices("shutdown_grace_ms", SHUTDOWN_GRACE_VAR),
    )
    """``HARU_SUPERVISOR_SHUTDOWN_GRACE_MS``: SIGTERM-to-SIGKILL grace of trainers when the
    supervisor itself shuts down."""
    stop_grace_s: float = Field(DEFAULT_STOP_GRACE_S, ge=0)
    """Grace of ``POST /v1/training/stop`` when the body names none."""
    trainer_env: Mapping[str, str] = Field(default_factory=_empty_env, repr=False, exclude=True)
    """The environment every trainer inherits, secrets already removed; ``HARU_CHECKPOINT_DIR``
    and ``HARU_GPU_INDEX`` are added per slot."""
    vllm_api_keys: Mapping[str, SecretStr] = Field(
        default_factory=_no_keys, repr=False, exclude=True
    )
    """A vLLM server's ``--api-key`` by model name (from ``apiKeyEnv`` / ``apiKeyFile``, see
    :func:`resolve_api_keys`); sent by the probe only, never logged."""
    search_path: str | None = None
    """``PATH`` on which ``nvidia-smi`` is looked up (None: the process's)."""

    @property
    def shutdown_grace_s(self) -> float:
        """:attr:`shutdown_grace_ms` in seconds."""
        return self.shutdown_grace_ms / 1000

    @model_validator(mode="after")
    def _strip_trainer_env(self) -> Settings:
        env = trainer_base_env(self.trainer_env, self.token_value())
        # The variables holding vLLM API keys are the supervisor's secrets too.
        for slot in self.config.inference_slots:
            for model in slot.models:
                if model.api_key_env is not None:
                    env.pop(model.api_key_env, None)
        object.__setattr__(self, "trainer_env", MappingProxyType(env))
        return self

    def token_value(self) -> str | None:
        """The token in clear, as read at start-up (see :meth:`token_source`)."""
        return None if self.token is None else self.token.get_secret_value()

    def token_source(
        self, *, monotonic: Callable[[], float] = time.monotonic
    ) -> TokenSource | None:
        """The token as the bearer check asks it on every request.

        It follows ``HARU_SUPERVISOR_TOKEN_FILE`` when that is set (the previous token
        accepted for :attr:`token_overlap_ms` after a change). A new source per call: build it
        once per process.
        """
        return self.token_source_of(
            TOKEN, monotonic=monotonic, overlap_s=self.token_overlap_ms / 1000
        )


def trainer_base_env(environ: Mapping[str, str], token: str | None) -> dict[str, str]:
    """The parent environment a trainer inherits: the supervisor's secrets removed.

    ``HARU_SUPERVISOR_TOKEN`` goes, and so does any variable whose value IS the token (the
    same secret exported under another name). Only exact matches: a substring test would drop
    ``PATH`` for a token such as ``bin``. The per-slot variables are dropped too: the caller
    sets them.
    """
    secret = normalize_token(token)
    dropped = {TOKEN_VAR, TOKEN_FILE_VAR, CHECKPOINT_DIR_VAR, GPU_INDEX_VAR}
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


def resolve_api_keys(config: SupervisorConfig, environ: Mapping[str, str]) -> dict[str, SecretStr]:
    """Each model's vLLM ``--api-key``, by model name.

    From the variable ``apiKeyEnv`` names, or the file ``apiKeyFile`` names (trimmed). Models
    without either have no entry.

    Raises:
        SettingsError: The variable is unset or blank, or the file is unreadable or blank
            (named; the key itself is never quoted).
    """
    keys: dict[str, SecretStr] = {}
    for slot in config.inference_slots:
        for model in slot.models:
            if model.api_key_env is not None:
                value = environ.get(model.api_key_env, "").strip()
                if not value:
                    raise SettingsError(
                        f"{CONFIG_VAR}: model {model.name!r}: apiKeyEnv names "
                        f"{_quote(model.api_key_env)!r}, which is unset or blank"
                    )
            elif model.api_key_file is not None:
                path = Path(model.api_key_file).expanduser()
                try:
                    value = path.read_text(encoding="utf-8").strip()
                except (OSError, UnicodeDecodeError) as exc:
                    raise SettingsError(
                        f"{CONFIG_VAR}: model {model.name!r}: cannot read apiKeyFile "
                        f"{_quote(str(path))!r}: "
                        f"{getattr(exc, 'strerror', None) or type(exc).__name__}"
                    ) from None
                if not value:
                    raise SettingsError(
                        f"{CONFIG_VAR}: model {model.name!r}: apiKeyFile {_quote(str(path))!r} "
                        "is empty"
                    )
            else:
                continue
            keys[model.name] = SecretStr(value)
    return keys


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Build :class:`Settings` from an environment mapping (``os.environ`` in production).

    Raises:
        SettingsError: A variable is missing or invalid (named; a token is never quoted).
    """
    config = load_config(environ.get(CONFIG_VAR, ""))
    try:
        return Settings.from_environ(
            environ,
            messages=_MESSAGES,
            config=config,
            trainer_env=environ,
            vllm_api_keys=resolve_api_keys(config, environ),
            search_path=environ.get("PATH"),
        )
    except EnvSettingsError as exc:
        raise SettingsError(str(exc)) from None
