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
from typing import Annotated, Any, Final, Literal, get_args

from haru_protocol import SupervisorConfig, normalize_token
from haru_web import (
    HOST_VAR,
    OPEN_BIND_VAR,
    TLS_CERT_FILE_VAR,
    TLS_CLIENT_CA_FILE_VAR,
    TLS_KEY_FILE_VAR,
    TRUSTED_PROXIES_VAR,
    EnvInt,
    ListenerSettings,
    TokenConfigError,
    TokenSource,
    check_token,
    choose_bind_host,
    is_loopback_bind,
    resolve_token,
)
from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

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
HEADER_TIMEOUT_VAR: Final = "HARU_HTTP_HEADER_TIMEOUT_MS"
BODY_IDLE_VAR: Final = "HARU_HTTP_BODY_IDLE_TIMEOUT_MS"
KEEPALIVE_VAR: Final = "HARU_HTTP_KEEPALIVE_TIMEOUT_MS"
MAX_CONNECTIONS_VAR: Final = "HARU_HTTP_MAX_CONNECTIONS"
MAX_CONNECTIONS_PER_PEER_VAR: Final = "HARU_HTTP_MAX_CONNECTIONS_PER_PEER"
METRICS_PUBLIC_VAR: Final = "HARU_METRICS_PUBLIC"
LOG_FORMAT_VAR: Final = "HARU_LOG_FORMAT"
LOG_LEVEL_VAR: Final = "HARU_LOG_LEVEL"
CONFIG_VAR: Final = "HARU_SUPERVISOR_CONFIG"
GPU_SOURCE_VAR: Final = "HARU_SUPERVISOR_GPU_SOURCE"
SHUTDOWN_GRACE_VAR: Final = "HARU_SUPERVISOR_SHUTDOWN_GRACE_MS"
CHECKPOINT_DIR_VAR: Final = "HARU_CHECKPOINT_DIR"
GPU_INDEX_VAR: Final = "HARU_GPU_INDEX"

# Error messages quote at most this much of a bad value or a validation report.
_QUOTE_LIMIT: Final = 2000


def _empty_env() -> Mapping[str, str]:
    return MappingProxyType({})


def _no_keys() -> Mapping[str, SecretStr]:
    return MappingProxyType({})


class _MappingEnv(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping, blank values dropped."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = {k: v.strip() for k, v in environ.items() if v.strip()}
        super().__init__(settings_cls, case_sensitive=True)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return dict(self._environ)


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

    config: SupervisorConfig
    """The parsed ``HARU_SUPERVISOR_CONFIG`` document."""
    port: Annotated[EnvInt, Field(ge=0, le=65535)] = Field(
        DEFAULT_PORT, validation_alias=AliasChoices("port", "PORT")
    )
    """``PORT``: TCP port to listen on (0 picks a free one and logs it)."""
    token: SecretStr | None = Field(None, validation_alias=AliasChoices("token", TOKEN_VAR))
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

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: Any, *_others: Any, **_kw: Any
    ) -> tuple[Any, ...]:
        # Only what is passed: load_settings() passes the environment it was given.
        return (init_settings,)

    @property
    def shutdown_grace_s(self) -> float:
        """:attr:`shutdown_grace_ms` in seconds."""
        return self.shutdown_grace_ms / 1000

    @field_validator("token", mode="before")
    @classmethod
    def _token(cls, value: object) -> object:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, str):
            try:
                return check_token(value, name=TOKEN_VAR)
            except TokenConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _read_token_file(self) -> Settings:
        # A file named without its token (built directly, not load_settings): read it now.
        if self.token_file is not None and self.token is None:
            try:
                token = resolve_token({TOKEN_FILE_VAR: str(self.token_file)}, TOKEN_VAR)
            except TokenConfigError as exc:
                raise ValueError(str(exc)) from None
            object.__setattr__(self, "token", None if token is None else SecretStr(token))
        return self

    @model_validator(mode="after")
    def _no_accidental_open_bind(self) -> Settings:
        choose_bind_host(
            self.bind_host,
            token_set=self.token is not None,
            allow_open=self.allow_open_bind,
            token_var=TOKEN_VAR,
        )
        return self

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
        if self.token is None:
            return None
        token = self.token.get_secret_value()
        if self.token_file is None:
            return TokenSource.constant(token)
        return TokenSource(
            token,
            path=self.token_file,
            name=TOKEN_FILE_VAR,
            monotonic=monotonic,
            overlap_s=self.token_overlap_ms / 1000,
        )

    @property
    def host(self) -> str:
        """``HARU_HOST``, else all interfaces with a token and loopback without one (DESIGN 6.2)."""
        return choose_bind_host(
            self.bind_host,
            token_set=self.token is not None,
            allow_open=self.allow_open_bind,
            token_var=TOKEN_VAR,
        )

    @property
    def open_to_network(self) -> bool:
        """No token, and listening beyond loopback (``HARU_ALLOW_OPEN_BIND``)."""
        return self.token is None and not is_loopback_bind(self.host)


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


_ENV_VARS: Final = {
    "PORT": "PORT",
    HOST_VAR: HOST_VAR,
    OPEN_BIND_VAR: OPEN_BIND_VAR,
    TOKEN_VAR: TOKEN_VAR,
    HEADER_TIMEOUT_VAR: HEADER_TIMEOUT_VAR,
    BODY_IDLE_VAR: BODY_IDLE_VAR,
    KEEPALIVE_VAR: KEEPALIVE_VAR,
    MAX_CONNECTIONS_VAR: MAX_CONNECTIONS_VAR,
    MAX_CONNECTIONS_PER_PEER_VAR: MAX_CONNECTIONS_PER_PEER_VAR,
    TRUSTED_PROXIES_VAR: TRUSTED_PROXIES_VAR,
    METRICS_PUBLIC_VAR: METRICS_PUBLIC_VAR,
    LOG_FORMAT_VAR: LOG_FORMAT_VAR,
    LOG_LEVEL_VAR: LOG_LEVEL_VAR,
    TLS_CERT_FILE_VAR: TLS_CERT_FILE_VAR,
    TLS_KEY_FILE_VAR: TLS_KEY_FILE_VAR,
    TLS_CLIENT_CA_FILE_VAR: TLS_CLIENT_CA_FILE_VAR,
    GPU_SOURCE_VAR: GPU_SOURCE_VAR,
    SHUTDOWN_GRACE_VAR: SHUTDOWN_GRACE_VAR,
    TOKEN_FILE_VAR: TOKEN_FILE_VAR,
    TOKEN_OVERLAP_VAR: TOKEN_OVERLAP_VAR,
}
_FIELD_VARS: Final = {
    "port": "PORT",
    "bind_host": HOST_VAR,
    "allow_open_bind": OPEN_BIND_VAR,
    "token": TOKEN_VAR,
    "token_file": TOKEN_FILE_VAR,
    "token_overlap_ms": TOKEN_OVERLAP_VAR,
    "http_header_timeout_ms": HEADER_TIMEOUT_VAR,
    "http_body_idle_timeout_ms": BODY_IDLE_VAR,
    "http_keepalive_timeout_ms": KEEPALIVE_VAR,
    "http_max_connections": MAX_CONNECTIONS_VAR,
    "http_max_connections_per_peer": MAX_CONNECTIONS_PER_PEER_VAR,
    "trusted_proxies": TRUSTED_PROXIES_VAR,
    "metrics_public": METRICS_PUBLIC_VAR,
    "log_format": LOG_FORMAT_VAR,
    "log_level": LOG_LEVEL_VAR,
    "tls_cert_file": TLS_CERT_FILE_VAR,
    "tls_key_file": TLS_KEY_FILE_VAR,
    "tls_client_ca_file": TLS_CLIENT_CA_FILE_VAR,
    "gpu_source": GPU_SOURCE_VAR,
    "shutdown_grace_ms": SHUTDOWN_GRACE_VAR,
}


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Build :class:`Settings` from an environment mapping (``os.environ`` in production).

    Raises:
        SettingsError: A variable is missing or invalid (named; a token is never quoted).
    """
    config = load_config(environ.get(CONFIG_VAR, ""))
    env = dict(environ)
    try:
        env[TOKEN_VAR] = resolve_token(env, TOKEN_VAR) or ""
    except TokenConfigError as exc:
        raise SettingsError(str(exc)) from None
    values = _MappingEnv(Settings, {k: v for k, v in env.items() if k in _ENV_VARS})()
    try:
        return Settings(
            config=config,
            trainer_env=environ,
            vllm_api_keys=resolve_api_keys(config, environ),
            search_path=environ.get("PATH"),
            **values,
        )
    except ValidationError as exc:
        parts = []
        for error in exc.errors(include_url=False, include_input=False, include_context=False):
            field = ".".join(str(p) for p in error["loc"])
            name = _FIELD_VARS.get(field, field)
            message = error["msg"].removeprefix("Value error, ")
            if name == "PORT":
                message = "must be an integer from 0 to 65535"
            parts.append(message if not name or message.startswith(name) else f"{name} {message}")
        raise SettingsError("; ".join(parts)) from None
