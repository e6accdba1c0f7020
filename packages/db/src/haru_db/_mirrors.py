"""Slot mirrors that ride an operation's compare-and-swap (one statement, only when it lands)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from haru_core import machine_for
from haru_protocol import SlotKind

from haru_db._exec import checked_froms


@dataclass(frozen=True, slots=True)
class SlotMirror:
    """Slot states an operation CAS moves in its own statement, only when the CAS lands.

    Every slot of ``kind`` on the operation's target domain (its source domain with
    ``on_source``) whose state is in ``from_states`` moves to ``to``, with the CAS time as its
    ``state_updated_at``, exactly as :meth:`~haru_db.StateStore.transition_domain_slots`
    would move them.
    """

    kind: SlotKind
    from_states: tuple[str, ...]
    to: str
    on_source: bool = False
    count_into: str | None = None
    """An exit mirror only: set the number of slots it moved into the payload of the first
    event the same statement appends, under this key (e.g. ``trainingSlotsIdle``)."""

    def document(self) -> dict[str, Any]:
        """The checked ``{"onSource", "kind", "from", "to", "countInto"}`` document.

        Raises:
            haru_core.InvalidTransitionError: A from-state cannot move to ``to``.
        """
        froms = checked_froms(machine_for(self.kind), self.from_states, self.to)
        return {
            "onSource": self.on_source,
            "kind": self.kind.value,
            "from": froms,
            "to": str(self.to),
            "countInto": self.count_into,
        }


def mirror_documents(exit: SlotMirror | None, entry: SlotMirror | None) -> dict[str, Any] | None:
    """The ``pending_mirrors`` document of one CAS, or None when it moves no slot.

    Raises:
        ValueError: Both mirrors act on the same slots (one statement may move a row once),
            or the entry mirror asks for a count.
    """
    if exit is None and entry is None:
        return None
    if (
        exit is not None
        and entry is not None
        and (exit.kind, exit.on_source)
        == (
            entry.kind,
            entry.on_source,
        )
    ):
        raise ValueError("the exit and entry mirrors of one CAS must move different slots")
    if entry is not None and entry.count_into is not None:
        raise ValueError("only an exit mirror can count the slots it moved into an event")
    return {
        "exit": None if exit is None else exit.document(),
        "entry": None if entry is None else entry.document(),
    }
