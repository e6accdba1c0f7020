"""A service's settings read from an environment mapping, and its boot errors naming variables.

Each settings field is read by its name or by its variable (``AliasChoices(field, VAR)``, the
variable in upper case). :func:`settings_from_env` keeps the variables a settings class reads,
drops blank values, decodes the rest through pydantic-settings' environment source (a mapping
the caller passes, never ``os.environ`` itself) and validates them; a validation error becomes
one line naming each bad variable, never its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import AliasChoices, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource

from haru_web._errors import HaruWebError


class EnvSettingsError(HaruWebError, ValueError):
    """A variable holds a value the service cannot use (a boot error naming it, never a token)."""


_Settings = TypeVar("_Settings", bound=BaseSettings)


class _MappingEnv(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping, blank values dropped."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = {k: v.strip() for k, v in environ.items() if v.strip()}
        super().__init__(settings_cls, case_sensitive=True)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return dict(self._environ)


def env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Field name -> the environment variable it is read from."""
    names: dict[str, str] = {}
    for field_name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str) and choice.isupper():
                    names[field_name] = choice
    return names


def env_values(cls: type[BaseSettings], environ: Mapping[str, str]) -> dict[str, Any]:
    """What ``environ`` sets for ``cls``, by variable: blank values and other variables left out.

    The values are decoded as pydantic-settings decodes the environment (JSON for complex
    fields unless they are marked ``NoDecode``); validating them is ``cls``'s job.
    """
    known = set(env_names(cls).values())
    return _MappingEnv(cls, {k: v for k, v in environ.items() if k in known})()


def settings_from_env(
    cls: type[_Settings],
    environ: Mapping[str, str],
    *,
    messages: Mapping[str, str] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> _Settings:
    """``cls`` built from what ``environ`` sets (:func:`env_values`) and ``fields`` as given.

    Raises:
        EnvSettingsError: A value is unusable (:func:`describe_settings_error`).
    """
    try:
        return cls(**(fields or {}), **env_values(cls, environ))
    except ValidationError as exc:
        message = describe_settings_error(exc, env_names(cls), messages=messages)
        raise EnvSettingsError(message) from None


def describe_settings_error(
    exc: ValidationError, names: Mapping[str, str], *, messages: Mapping[str, str] | None = None
) -> str:
    """A boot error naming each bad variable, without its value.

    Args:
        exc: What validating the settings raised.
        names: Field name -> its variable (:func:`env_names`).
        messages: Variable -> the message that replaces pydantic's for it (a range said in
            words, say).
    """
    parts = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        field = ".".join(str(p) for p in error["loc"])
        name = names.get(field, field)
        message = error["msg"].removeprefix("Value error, ")
        if messages is not None and name in messages:
            message = messages[name]
        parts.append(message if not name or message.startswith(name) else f"{name} {message}")
    return "; ".join(parts)
