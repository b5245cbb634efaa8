from __future__ import annotations

import io
import math

import pytest

from pipetrain.trace import ProgressBar, format_duration, format_rate


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_line_format_with_eta() -> None:
    clock, log = Clock(), io.StringIO()
    bar = ProgressBar(200, stream=log, bar_width=12, clock=clock)
    clock.now = 4.8  # 12 steps in 4.8 s: 0.4 s a step, 188 to go
    bar.update(12, loss=2.31449, tokens_per_s=12_345.0, bubble=0.18)
    assert log.getvalue() == (
        "step 12/200 [>           ] loss 2.314  12.3k tok/s  bubble 18%  ETA 1m15s\n"
    )


def test_bar_fills_and_optional_figures() -> None:
    log = io.StringIO()
    bar = ProgressBar(4, stream=log, bar_width=8, clock=Clock())
    bar.update(2)
    bar.update(4, loss=0.5)
    assert log.getvalue().splitlines() == [
        "step 2/4 [====>   ]",
        "step 4/4 [========] loss 0.500",
    ]


def test_terminal_rewrites_one_line_in_place() -> None:
    terminal = Terminal()
    bar = ProgressBar(100, stream=terminal, bar_width=10, clock=Clock())
    bar.update(9, loss=10.123456)
    bar.update(10, loss=1.5)
    assert "\n" not in terminal.getvalue()
    first, second = terminal.getvalue().split("\r")[1:]
    assert first == "step 9/100 [>         ] loss 10.123"
    assert second == "step 10/100 [=>        ] loss 1.500"
    bar.close()
    bar.close()  # once is enough
    assert terminal.getvalue().endswith("loss 1.500\n")
    assert terminal.getvalue().count("\n") == 1


def test_terminal_pads_a_shorter_line() -> None:
    terminal = Terminal()
    bar = ProgressBar(10, stream=terminal, bar_width=4, clock=Clock())
    bar.update(1, tokens_per_s=1e6)
    bar.update(2)
    first, second = terminal.getvalue().split("\r")[1:]
    assert second.rstrip() == "step 2/10 [>   ]"
    assert len(second) == len(first)


def test_log_stream_writes_every_n_steps_and_the_last() -> None:
    log = io.StringIO()
    with ProgressBar(
        12, stream=log, log_every_steps=5, log_every_seconds=math.inf, clock=Clock()
    ) as bar:
        for step in range(1, 13):
            bar.update(step)
    steps = [line.split()[1] for line in log.getvalue().splitlines()]
    assert steps == ["1/12", "6/12", "11/12", "12/12"]
    assert "\r" not in log.getvalue()


def test_log_stream_writes_every_n_seconds() -> None:
    clock, log = Clock(), io.StringIO()
    bar = ProgressBar(1000, stream=log, log_every_steps=1000, log_every_seconds=30, clock=clock)
    for step in range(1, 101):
        clock.now = step * 1.0  # a step a second
        bar.update(step)
    steps = [int(line.split()[1].split("/")[0]) for line in log.getvalue().splitlines()]
    assert steps == [1, 31, 61, 91]
    bar.close()  # the last update was not written yet: close writes it
    assert log.getvalue().splitlines()[-1].startswith("step 100/1000")
    assert len(log.getvalue().splitlines()) == 5


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(3)
    bar.update(3)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("step 3/3 [")


def test_resumed_run_eta_counts_from_the_initial_step() -> None:
    clock, log = Clock(), io.StringIO()
    bar = ProgressBar(200, stream=log, initial_step=100, clock=clock)
    clock.now = 10.0  # 10 steps in 10 s
    bar.update(110)
    assert log.getvalue().rstrip().endswith("ETA 1m30s")


def test_mistakes() -> None:
    with pytest.raises(ValueError) as info:
        ProgressBar(0, bar_width=0, log_every_steps=0, log_every_seconds=-1)
    message = str(info.value)
    for name in ("total_steps=0", "bar_width=0", "log_every_steps=0", "log_every_seconds=-1"):
        assert name in message
    bar = ProgressBar(10, stream=io.StringIO())
    with pytest.raises(ValueError, match=r"bubble=18 must be a fraction .*0.18 for 18%"):
        bar.update(1, bubble=18)


def test_formats() -> None:
    assert [format_rate(v) for v in (0, 999.4, 999.6, 1500, 123_456, 1e6, 3.21e9)] == [
        "0",
        "999",
        "1.00k",
        "1.50k",
        "123k",
        "1.00M",
        "3.21G",
    ]
    assert [format_duration(s) for s in (0, 59.4, 60, 3599, 3600, 90061, math.inf)] == [
        "0s",
        "59s",
        "1m00s",
        "59m59s",
        "1h00m",
        "25h01m",
        "?",
    ]
