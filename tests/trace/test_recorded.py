from __future__ import annotations

import math

import pytest

from pipetrain.schedule import TimedAction, parse_action
from pipetrain.trace import align_ranks, check_timeline, offsets_from_origins


def _t(rank: int, action: str, start: float, end: float) -> TimedAction:
    return TimedAction(rank, parse_action(action), start, end)


def test_check_reports_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        check_timeline(
            [
                _t(0, "0F0", 1.0, 0.5),
                _t(-1, "0F1", 0.0, 1.0),
                _t(1, "1F0", math.nan, 1.0),
                _t(1, "1F1", 0.0, 1.0),
            ]
        )
    message = str(info.value)
    assert "rank 0 action 0F0 ends before it starts" in message
    assert "rank -1 action 0F1" in message
    assert "times must be finite" in message
    assert "1F1" not in message


def test_check_rejects_other_items() -> None:
    with pytest.raises(TypeError, match="TimedAction"):
        check_timeline([(0, parse_action("0F0"), 0.0, 1.0)])


def test_offsets_and_alignment_put_ranks_on_the_earliest_origin() -> None:
    # each rank timed its F from its own origin; the origins on the shared wall clock
    origins = [1000.5, 1000.0]
    offsets = offsets_from_origins(origins)
    assert offsets == (0.5, 0.0)
    aligned = align_ranks([_t(0, "0F0", 0.0, 1.0), _t(1, "1F0", 1.5, 2.5)], offsets)
    assert [(t.start, t.end) for t in aligned] == [(0.5, 1.5), (1.5, 2.5)]
    assert [t.action for t in aligned] == [parse_action("0F0"), parse_action("1F0")]


def test_align_needs_an_offset_per_rank() -> None:
    with pytest.raises(ValueError, match=r"no offset for rank\(s\) \[2\]"):
        align_ranks([_t(2, "2F0", 0.0, 1.0)], [0.0, 0.0])
    with pytest.raises(ValueError, match="offset of rank 1 is inf"):
        align_ranks([], [0.0, math.inf])
    with pytest.raises(ValueError, match="finite wall-clock"):
        offsets_from_origins([0.0, math.nan])
