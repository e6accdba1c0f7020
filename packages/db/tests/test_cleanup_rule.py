"""The promote-failure cleanup rule has one Python source, and the SQLite trigger matches it."""

from __future__ import annotations

import re

import sqlalchemy as sa
from haru_core import INFERENCE_TRANSITIONS, TRAINING_TRANSITIONS
from haru_db import StateStore
from haru_db._cleanup import PROMOTE_FAIL_CLEANUP
from haru_db._engine import create_engine
from haru_protocol import InferenceSlotState, TrainingSlotState


def _states(text: str) -> tuple[str, ...]:
    return tuple(re.findall(r"'([a-z_]+)'", text))


async def test_the_sqlite_trigger_spells_the_rule(sqlite_store: StateStore) -> None:
    engine = create_engine(sqlite_store.url)
    try:
        async with engine.connect() as conn:
            sql = await conn.scalar(
                sa.text(
                    "SELECT sql FROM sqlite_master WHERE type = 'trigger' "
                    "AND name = 'trg_operations_promote_failed_cleanup'"
                )
            )
    finally:
        await engine.dispose()
    assert isinstance(sql, str)
    flat = " ".join(sql.split())
    inference, training = flat.split("UPDATE slots")[1:]
    rule = PROMOTE_FAIL_CLEANUP

    assert _states(re.search(r"SET state = ('[a-z]+')", inference)[1]) == (rule.inference_to,)  # type: ignore[index]
    wake_path = re.search(r"state IN \(([^)]*)\)", inference)
    assert wake_path is not None
    assert set(_states(wake_path[1])) == set(rule.inference_failed_from)
    unless_routed = re.search(r"OR \(state = ('[a-z]+') AND NOT EXISTS", inference)
    assert unless_routed is not None
    assert _states(unless_routed[1]) == rule.inference_failed_unless_routed
    assert "fleets.active_domain_id = NEW.target_domain_id" in inference

    assert _states(re.search(r"SET state = ('[a-z]+')", training)[1]) == (rule.training_to,)  # type: ignore[index]
    resumed = re.search(r"kind = 'training' AND state = ('[a-z]+')", training)
    assert resumed is not None
    assert _states(resumed[1]) == rule.training_resumed_from


def test_haru_core_tables_allow_every_change_of_the_rule() -> None:
    PROMOTE_FAIL_CLEANUP.check()
    for machine, from_state, to_state in PROMOTE_FAIL_CLEANUP.changes():
        if machine == "inference":
            allowed = INFERENCE_TRANSITIONS[InferenceSlotState(from_state)]
            assert InferenceSlotState(to_state) in allowed
        else:
            assert (
                TrainingSlotState(to_state) in TRAINING_TRANSITIONS[TrainingSlotState(from_state)]
            )
