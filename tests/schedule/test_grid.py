from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Costs,
    TimedAction,
    gpipe,
    interleaved_1f1b,
    parse_action,
    render_grid,
    simulate,
)

from .helpers import make


def test_longer_actions_continue_over_ticks() -> None:
    assert render_grid(simulate(gpipe(2, 2), Costs(forward=1, backward=2))) == (
        "rank 0: F0 F1 .  .  .  B0 -- B1 --\nrank 1: .  F0 F1 B0 -- B1 --"
    )


def test_measured_float_times() -> None:
    # e.g. perf_counter seconds: laid out from the earliest action, one tick = the shortest
    timeline = [
        TimedAction(0, parse_action("0F0"), 1000.010, 1000.020),
        TimedAction(0, parse_action("0B0"), 1000.041, 1000.061),
        TimedAction(1, parse_action("1F0"), 1000.021, 1000.0305),
        TimedAction(1, parse_action("1B0"), 1000.031, 1000.040),
    ]
    assert render_grid(timeline) == "rank 0: F0 .  .  B0 --\nrank 1: .  F0 B0"
    assert render_grid(timeline, tick=0.005) == (
        "rank 0: F0 -- .  .  .  .  B0 -- -- --\nrank 1: .  .  F0 -- B0 --"
    )


def test_virtual_stages_are_named() -> None:
    grid = render_grid(interleaved_1f1b(2, 2))
    assert grid.splitlines()[1].startswith("rank 1: .   1F0 1F1 3F0 3B0")


def test_many_ranks_align() -> None:
    lines = render_grid(gpipe(11, 1)).splitlines()
    assert lines[0].startswith("rank  0: F0") and lines[10].startswith("rank 10: .  .")


def test_deadlocked_schedule_shows_what_ran() -> None:
    assert render_grid(make("0RB0 0F0 0SF0 0B0", "1RF0 1F0 1B0 1SB0")) == "rank 0:\nrank 1:"


def test_rejects_a_non_positive_tick() -> None:
    with pytest.raises(ValueError, match="tick must be positive, got 0"):
        render_grid(simulate(gpipe(2, 1)), tick=0)
