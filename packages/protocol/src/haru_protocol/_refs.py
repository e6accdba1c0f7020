"""The fleet-reference rule (DESIGN 3.1): how a path segment or header names a fleet.

One function, :func:`parse_fleet_ref`, used by the store, the route cache and the API, so the
rule cannot drift between them: a UUID-shaped reference (any case) is looked up as an id
FIRST, then as a slug (a slug may look like a UUID); any other string is a slug, compared
case-sensitively. A string that is neither UUID-shaped nor a valid slug names no fleet, and
nothing is asked of the store for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from uuid import UUID

from haru_protocol._base import is_slug

MAX_FLEET_REF_LENGTH = 63
"""Longest reference that can name a fleet (a slug's limit; a UUID has 36 characters)."""

# ASCII classes only, matched over the whole string: no surrounding whitespace, no trailing
# newline (``$`` would accept one), no braces or ``urn:uuid:`` prefix (``uuid.UUID`` would).
_UUID_SHAPE = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


@dataclass(frozen=True, slots=True)
class FleetRef:
    """A parsed fleet reference.

    Attributes:
        text: The reference exactly as given.
        id: The fleet id it names when it is UUID-shaped (looked up first), else None.
        slug: The slug it names when it is a valid slug (looked up second), else None. A
            lowercase UUID is also a valid slug; an uppercase one is not.
    """

    text: str
    id: UUID | None
    slug: str | None

    @property
    def names_nothing(self) -> bool:
        """Whether no fleet can have this reference (neither an id nor a slug)."""
        return self.id is None and self.slug is None

    @property
    def key(self) -> str:
        """A canonical spelling: ids compare lowercase, slugs case-sensitively."""
        return str(self.id) if self.id is not None else self.text

    def choose(self, candidates: Mapping[UUID, str]) -> UUID | None:
        """Apply "id first, then slug" to the fleets a lookup found.

        Args:
            candidates: Fleet id to slug of every fleet matching either the id or the slug.

        Returns:
            The id match when there is one, else the slug match, else None.
        """
        if self.id is not None and self.id in candidates:
            return self.id
        if self.slug is None:
            return None
        return next((fid for fid, slug in candidates.items() if slug == self.slug), None)

    def may_alias(self, fleet_id: UUID) -> bool:
        """Whether this spelling may be remembered as a name of ``fleet_id``.

        A UUID-shaped slug never is: an id lookup of the same string may name another fleet.
        """
        return self.id is None or self.id == fleet_id


def parse_fleet_ref(ref: str) -> FleetRef:
    """Parse a fleet reference (a URL path segment, the ``X-Haru-Fleet`` header, a setting).

    Never raises: a reference that cannot name a fleet (empty, overlong, whitespace, a
    control character, non-ASCII, uppercase non-UUID) comes back with
    :attr:`FleetRef.names_nothing` set, which callers answer with "fleet not found".
    """
    if not 1 <= len(ref) <= MAX_FLEET_REF_LENGTH:
        return FleetRef(ref, None, None)
    fleet_id = UUID(ref) if _UUID_SHAPE.fullmatch(ref) is not None else None
    return FleetRef(ref, fleet_id, ref if is_slug(ref) else None)
