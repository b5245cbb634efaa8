from __future__ import annotations

import pytest

from pipetrain.schedule import Action, Op, format_actions, parse_action, parse_actions


def test_op_hash_is_consistent_with_equality() -> None:
    assert {Op.FORWARD: 1}[Op("F")] == 1
    assert len({op for op in Op} | {Op(op.value) for op in Op}) == len(Op)
    assert hash(Action(0, Op.FORWARD, 1)) == hash(parse_action("0F1"))


def test_round_trip_of_every_op() -> None:
    text = "0F3 1B2 2I0 2W0 1SF3 2RF3 2SB3 1RB3 0REDUCE 0STEP 3F1v2"
    assert format_actions(parse_actions(text)) == text


@pytest.mark.parametrize("text", ["F3", "0X1", "0F", "0STEP1"])
def test_malformed_actions_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        parse_action(text)
