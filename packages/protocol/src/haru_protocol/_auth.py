"""Bearer-token helpers shared by the server and the supervisor."""

from __future__ import annotations

import hmac


def normalize_token(value: str | None) -> str | None:
    """Trim a configured token; a blank or missing value means "no token"."""
    if value is None:
        return None
    trimmed = value.strip()
    return trimmed or None


def bearer_matches(authorization: str | None, expected: str | None) -> bool:
    """Check an ``Authorization`` header against the expected bearer token.

    A blank or missing ``expected`` token means the API is open and every request matches.
    The scheme is case-insensitive; the token comparison runs in constant time.
    """
    token = normalize_token(expected)
    if token is None:
        return True
    if authorization is None:
        return False
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        offered = presented.strip().encode()
    except UnicodeEncodeError:
        # Bytes that are not UTF-8 (an HTTP server keeps them as lone surrogates): no match.
        return False
    return hmac.compare_digest(offered, token.encode())


def bearer_header(token: str | None) -> dict[str, str]:
    """Headers that present ``token`` (none when it is blank)."""
    normalized = normalize_token(token)
    return {} if normalized is None else {"Authorization": f"Bearer {normalized}"}
