"""Bearer tokens from the environment or a file: one rule for both services."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

from haru_web._errors import HaruWebError

MIN_TOKEN_LENGTH: Final = 16
"""Shortest token a service accepts: a short one is guessable, and as a substring it is
everywhere (a token ``bin`` is inside ``PATH``)."""

FILE_SUFFIX: Final = "_FILE"


class TokenConfigError(HaruWebError, ValueError):
    """A token variable, or the file it points to, is unusable (a start-up error)."""


def check_token(value: str | None, *, name: str) -> str | None:
    """Trim ``value``; blank means no token; shorter than 16 characters is refused.

    Raises:
        TokenConfigError: The token is too short (the message never contains it).
    """
    if value is None:
        return None
    token = value.strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenConfigError(
            f"{name} is {len(token)} characters long; use at least {MIN_TOKEN_LENGTH} "
            "(for example: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def resolve_token(env: Mapping[str, str], name: str) -> str | None:
    """The token of variable ``name``, or of the file named by ``<name>_FILE``.

    A file keeps the token out of the process environment (which same-user processes can read
    from ``/proc/<pid>/environ``); its content is trimmed. Setting both is refused.

    Raises:
        TokenConfigError: Both are set, the file cannot be read, or the token is too short.
    """
    file_name = name + FILE_SUFFIX
    inline = env.get(name, "").strip()
    path = env.get(file_name, "").strip()
    if inline and path:
        raise TokenConfigError(f"set either {name} or {file_name}, not both")
    if not path:
        return check_token(inline, name=name)
    try:
        content = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise TokenConfigError(f"{file_name}: cannot read {path!r}: {reason}") from None
    token = check_token(content, name=f"the token in {file_name}")
    if token is None:
        raise TokenConfigError(f"{file_name}: {path!r} is empty")
    return token
