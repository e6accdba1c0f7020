"""PostgreSQL's operation CAS is built once per shape and reused with new parameters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import sqlalchemy as sa
from haru_db import OperationEvent, SlotMirror
from haru_db._mirrors import mirror_documents
from haru_db._postgres import operation_cas
from haru_protocol import SlotKind
from sqlalchemy import create_engine

AT = datetime(2030, 1, 1, tzinfo=UTC)


def _cas(
    step: str, payload: dict[str, object], *, counted: bool = True
) -> tuple[sa.Select[Any], dict[str, Any]]:
    mirrors = mirror_documents(
        SlotMirror(
            SlotKind.TRAINING,
            ("stopping",),
            "idle",
            count_into="trainingSlotsIdle" if counted else None,
        ),
        SlotMirror(SlotKind.INFERENCE, ("sleeping",), "waking"),
    )
    return operation_cas(
        "advance",
        operation_id=uuid4(),
        from_step=step,
        to_step="wake_vllm",
        at=AT + timedelta(seconds=len(step)),
        documents=[OperationEvent("operation.step.done", payload).document()],
        mirrors=mirrors,
    )


def test_one_statement_per_shape_whatever_the_values() -> None:
    first, first_params = _cas("verify_gpu", {"step": "verify_gpu"})
    second, second_params = _cas("stop_training", {"step": "stop_training", "n": 2})
    assert first is second
    assert first_params["p_op_id"] != second_params["p_op_id"]
    assert first_params["p_from_step"] == "verify_gpu"
    assert second_params["p_payload_0"] == {"step": "stop_training", "n": 2}
    assert first_params["p_exit_from"] == ["stopping"]
    assert first_params["p_count_into"] == ["trainingSlotsIdle"]
    # Another shape (no count into the event) is another statement.
    other, other_params = _cas("verify_gpu", {"step": "verify_gpu"}, counted=False)
    assert other is not first
    assert "p_count_into" not in other_params


def test_every_value_is_a_bind_parameter() -> None:
    stmt, params = _cas("verify_gpu", {"step": "verify_gpu", "secretish": "zz-unique-value"})
    dialect = create_engine("postgresql+psycopg://").dialect  # no connection is made
    sql = str(stmt.compile(dialect=dialect))
    for value in ("verify_gpu", "wake_vllm", "zz-unique-value", "stopping", "trainingSlotsIdle"):
        assert value not in sql
    for name in params:
        assert name in sql
