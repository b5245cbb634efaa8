from __future__ import annotations

import struct
from pathlib import Path

from pipetrain.schedule import (
    Costs,
    TimedAction,
    add_optimizer_step,
    interleaved_1f1b,
    parse_action,
    render_timeline,
    simulate,
    zb_h1,
)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_simulated_timeline_with_every_op(tmp_path: Path) -> None:
    schedule = add_optimizer_step(zb_h1(4, 8), reduce=True)
    result = simulate(schedule, Costs(reduce=1.5, step=0.5))
    path = tmp_path / "zb.png"
    render_timeline(result.timeline, path, title="ZB-H1")
    width, height = _png_size(path)
    assert width >= 800 and height >= 200


def test_eight_ranks_sixteen_microbatches_stays_a_sane_size(tmp_path: Path) -> None:
    result = simulate(interleaved_1f1b(8, 16))
    path = tmp_path / "interleaved.png"
    render_timeline(result.timeline, path, time_unit="ticks")
    width, height = _png_size(path)
    assert width <= 6000 and 300 <= height <= 1000


def test_measured_seconds(tmp_path: Path) -> None:
    timeline = [
        TimedAction(0, parse_action("0F0"), 5321.0012, 5321.0025),
        TimedAction(1, parse_action("1F0"), 5321.0027, 5321.0031),
        TimedAction(1, parse_action("1RB0"), 5321.0031, 5321.0031),
        TimedAction(0, parse_action("0STEP"), 5321.004, 5321.004),  # zero-length box
    ]
    path = tmp_path / "measured.png"
    render_timeline(timeline, str(path), title="measured", time_unit="s")
    assert _png_size(path)[0] > 0


def test_empty_timeline(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    render_timeline([], path)
    assert path.stat().st_size > 0


def test_receive_waits_are_drawn_only_when_asked(tmp_path: Path) -> None:
    timeline = [
        TimedAction(0, parse_action("0F0"), 0.0, 1.0),
        TimedAction(0, parse_action("0SF0"), 1.0, 1.0),
        TimedAction(1, parse_action("1RF0"), 0.0, 1.5),
        TimedAction(1, parse_action("1F0"), 1.5, 2.5),
        TimedAction(1, parse_action("1RF1"), 2.5, 2.5),  # no wait: nothing to draw
    ]
    plain, waits = tmp_path / "plain.png", tmp_path / "waits.png"
    render_timeline(timeline, plain, time_unit="ms")
    render_timeline(timeline, waits, time_unit="ms", waits=True)
    assert _png_size(plain) == _png_size(waits)
    assert plain.read_bytes() != waits.read_bytes()
    again = tmp_path / "again.png"
    render_timeline(timeline, again, time_unit="ms")
    assert again.read_bytes() == plain.read_bytes()  # so the difference is the waits
