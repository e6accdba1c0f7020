"""Which fleet each spelling of a fleet reference names, as the route cache learned it.

Each accepted spelling (slug, id in any case) is indexed onto the fleet id with the database's
id-first rule (DESIGN 7.5), and a slug that looks like a UUID is never an alias. Newer knowledge
always wins: an index change only applies when its pointer read started after the last one
recorded for that spelling, and a spelling the store disclaimed stays disclaimed for reads
that started before that (a bounded, least-recently-disclaimed-first memo).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final
from uuid import UUID

from haru_protocol import parse_fleet_ref

from haru_server._errors import FleetNotFoundError

_REF_KEYS_MAX: Final = 1024
_ref_keys: dict[str, str | None] = {}


def ref_key(ref: str) -> str | None:
    """The cache key of a fleet reference, or None when it names nothing (memoized).

    Requests name the same few fleets over and over, so the parse is done once per spelling
    (at most :data:`_REF_KEYS_MAX` remembered; the memo starts over when full).
    """
    try:
        return _ref_keys[ref]
    except KeyError:
        pass
    parsed = parse_fleet_ref(ref)
    key = None if parsed.names_nothing else parsed.key
    if len(_ref_keys) >= _REF_KEYS_MAX:
        _ref_keys.clear()
    _ref_keys[ref] = key
    return key


def cache_key(ref: str) -> str:
    """The cache key of a fleet reference (DESIGN 7.5's id-first rule, one spelling per fleet).

    Raises:
        FleetNotFoundError: ``ref`` is neither an id nor a slug: no fleet can have it, so the
            store is not asked.
    """
    key = ref_key(ref)
    if key is None:
        raise FleetNotFoundError(ref[:100])
    return key


class FleetAliases:
    """Spelling key -> fleet id, each with the sequence number of the read that taught it.

    Args:
        max_disclaimed: How many disclaimed spellings are remembered (oldest forgotten first).
    """

    def __init__(self, *, max_disclaimed: int) -> None:
        self._max_disclaimed = max_disclaimed
        self._aliases: dict[str, tuple[UUID, int]] = {}
        """spelling key -> (fleet id, sequence number of the pointer read that taught it)."""
        self._by_fleet: dict[UUID, set[str]] = {}
        """fleet id -> the spellings indexed onto it."""
        self._disclaimed: OrderedDict[str, int] = OrderedDict()
        """spelling key -> sequence number of the read that disclaimed it (bounded)."""

    def get(self, key: str) -> UUID | None:
        """The fleet id ``key`` is indexed onto, or None."""
        alias = self._aliases.get(key)
        return None if alias is None else alias[0]

    def disclaimed_after(self, key: str, seq: int) -> bool:
        """Whether a read numbered above ``seq`` said ``key`` names no fleet."""
        return self._disclaimed.get(key, -1) > seq

    def learn(self, fleet_id: UUID, key: str, seq: int) -> None:
        """Read number ``seq`` found ``key`` naming ``fleet_id`` (ignored when older news)."""
        if not parse_fleet_ref(key).may_alias(fleet_id):
            return  # a UUID-shaped slug is never an alias: an id lookup may name another fleet
        current = self._aliases.get(key)
        if (
            current is not None
            and current[0] == fleet_id
            and key in self._by_fleet.get(fleet_id, ())
        ):
            return
        if self.disclaimed_after(key, seq):
            return  # disclaimed by a read that started after this one
        if current is not None:
            if current[1] > seq:
                return
            if current[0] != fleet_id:
                self._by_fleet.get(current[0], set()).discard(key)
        self._aliases[key] = (fleet_id, seq)
        self._by_fleet.setdefault(fleet_id, set()).add(key)
        self._disclaimed.pop(key, None)

    def disclaim(self, key: str, seq: int) -> UUID | None:
        """Read number ``seq`` found ``key`` naming no fleet; returns the fleet it named."""
        self._disclaimed[key] = max(seq, self._disclaimed.get(key, -1))
        self._disclaimed.move_to_end(key)
        while len(self._disclaimed) > self._max_disclaimed:
            self._disclaimed.popitem(last=False)
        alias = self._aliases.pop(key, None)
        if alias is None:
            return None
        self._by_fleet.get(alias[0], set()).discard(key)
        return alias[0]

    def unlink(self, fleet_id: UUID) -> None:
        """Forget every spelling indexed onto ``fleet_id`` (its cache entry is gone)."""
        for key in self._by_fleet.pop(fleet_id, ()):
            alias = self._aliases.get(key)
            if alias is not None and alias[0] == fleet_id:
                del self._aliases[key]
