"""The user a training slot's trainer runs as (``runAs``).

A trainer running as the supervisor's own user can read ``/proc/<supervisor pid>/environ``
and any file the supervisor can, its token included. Running it as another user closes that:
the kernel only lets the same user (or root) read a process's environment. Changing user
needs root, so a ``runAs`` on a supervisor that is not root is refused at start-up rather
than failing at the first training start.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass

from haru_protocol import SupervisorConfig, SupervisorTrainingSlot

from haru_supervisor._errors import SettingsError


@dataclass(frozen=True, slots=True)
class RunAs:
    """A resolved ``runAs``: the ids to spawn with and the user's login environment."""

    name: str
    uid: int
    gid: int
    home: str


def resolve_run_as(
    slot: SupervisorTrainingSlot, *, euid: Callable[[], int] = os.geteuid
) -> RunAs | None:
    """The slot's ``runAs`` user, or None when it has none.

    Raises:
        SettingsError: The supervisor is not root, or the user does not exist.
    """
    wanted = slot.run_as
    if wanted is None:
        return None
    where = f"training slot on GPU {slot.gpu_index}: runAs {wanted!r}"
    if euid() != 0:
        raise SettingsError(
            f"{where} needs the supervisor to run as root (it runs as uid {euid()}); "
            "start it as root or remove runAs"
        )
    try:
        entry = pwd.getpwuid(int(wanted)) if wanted.isdigit() else pwd.getpwnam(wanted)
    except (KeyError, OverflowError):
        raise SettingsError(f"{where}: no such user on this host") from None
    return RunAs(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def check_run_as(config: SupervisorConfig, *, euid: Callable[[], int] = os.geteuid) -> None:
    """Resolve every training slot's ``runAs`` (see :func:`resolve_run_as`).

    Raises:
        SettingsError: One cannot be honoured.
    """
    for slot in config.training_slots:
        resolve_run_as(slot, euid=euid)
