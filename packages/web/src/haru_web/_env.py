"""Field types both services' settings share (parsed from the environment)."""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import BeforeValidator, SecretStr

from haru_web._logs import parse_log_level
from haru_web._peers import Network, parse_trusted_proxies
from haru_web._tokens import check_token

_DIGITS: Final = re.compile(r"[0-9]{1,20}")


def _ascii_int(value: object) -> object:
    if isinstance(value, str):
        text = value.strip()
        if _DIGITS.fullmatch(text) is None:
            raise ValueError("must be a non-negative integer in ASCII digits")
        return int(text)
    return value


def _trusted_proxies(value: object) -> object:
    return parse_trusted_proxies(value) if isinstance(value, str) else value


def _log_level(value: object) -> object:
    return parse_log_level(value) if isinstance(value, str) else value


EnvInt = Annotated[int, BeforeValidator(_ascii_int)]
"""An integer that, from the environment, must be ASCII digits only (no sign, ``_``, or
non-ASCII digits that ``int()`` would accept)."""

EnvLogLevel = Annotated[int, BeforeValidator(_log_level)]
"""A :mod:`logging` level; from the environment one of :data:`LOG_LEVELS`."""

TrustedProxies = Annotated[tuple[Network, ...], BeforeValidator(_trusted_proxies)]
"""``HARU_TRUSTED_PROXIES``: from the environment a comma-separated list of addresses or
networks (``10.0.0.0/8, 192.0.2.7``); blank is none. (A service's settings add pydantic-settings'
``NoDecode``: the value is not JSON.)"""


def token_validator(name: str) -> BeforeValidator:
    """The check of a token field (``SecretStr | None``), its errors naming it ``name``.

    Trimmed; blank is no token; shorter than :data:`MIN_TOKEN_LENGTH` is refused (a
    :class:`TokenConfigError`, which never quotes the token).
    """

    def check(value: object) -> object:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        return check_token(value, name=name) if isinstance(value, str) else value

    return BeforeValidator(check)
