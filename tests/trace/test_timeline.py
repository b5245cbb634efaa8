from __future__ import annotations

import struct
from pathlib import Path

import pytest

from pipetrain.schedule import Costs, TimedAction, build_schedule, parse_action, simulate
from pipetrain.trace import render_measured_timeline


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_simulated_step_in_seconds(tmp_path: Path) -> None:
    schedule = build_schedule(
        "1f1b", num_ranks=4, num_microbatches=8, optimizer_step=True, reduce=True
    )
    # seconds, as the runtime records them: 2 ms forward, 4 ms backward, 0.3 ms latency
    costs = Costs(forward=0.002, backward=0.004, communication=0.0003, step=0.001)
    path = tmp_path / "measured.png"
    render_measured_timeline(simulate(schedule, costs).timeline, path, title="1F1B, measured")
    width, height = _png_size(path)
    assert width >= 800 and height >= 200


def test_recorded_step_at_clock_times_and_default_title(tmp_path: Path) -> None:
    step = [
        TimedAction(0, parse_action("0F0"), 5321.0012, 5321.0025),
        TimedAction(0, parse_action("0SF0"), 5321.0025, 5321.0025),
        TimedAction(1, parse_action("1RF0"), 5321.0012, 5321.0027),
        TimedAction(1, parse_action("1F0"), 5321.0027, 5321.0031),
        TimedAction(0, parse_action("0STEP"), 5321.004, 5321.004),
    ]
    path = tmp_path / "step.png"
    render_measured_timeline(step, str(path))
    assert path.stat().st_size > 1000


def test_invalid_timeline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        render_measured_timeline(
            [TimedAction(0, parse_action("0F0"), 1.0, 0.0)], tmp_path / "x.png"
        )
    assert not (tmp_path / "x.png").exists()
