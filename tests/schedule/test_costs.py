from __future__ import annotations

import pytest

from pipetrain.schedule import Costs


def test_defaults_are_derived() -> None:
    costs = Costs(forward=(1, 2)).per_stage(2)
    assert costs.forward == (1.0, 2.0)
    assert costs.backward == (2.0, 4.0)
    assert costs.backward_input == costs.backward_weight == (1.0, 2.0)
    assert costs.communication == costs.reduce == costs.step == (0.0, 0.0)


def test_given_values_win() -> None:
    costs = Costs(forward=1, backward=3, backward_input=2, communication=0.5).per_stage(3)
    assert costs.backward == (3.0,) * 3
    assert costs.backward_input == (2.0,) * 3
    assert costs.backward_weight == (1.5,) * 3
    assert costs.communication == (0.5,) * 3


def test_parse() -> None:
    assert Costs.parse("forward=1,backward=2,communication=0.1") == Costs(
        forward=1, backward=2, communication=0.1
    )
    assert Costs.parse(" forward = 1:1:2 , step=3 ") == Costs(forward=(1.0, 1.0, 2.0), step=3.0)
    assert Costs.parse("") == Costs()


@pytest.mark.parametrize(
    "text, message",
    [
        ("fwd=1", "unknown cost 'fwd' in 'fwd=1'; known: forward, backward"),
        ("forward=abc", "cost forward='abc' is not a number"),
        ("forward", "'forward' is not name=value"),
        ("forward=1,forward=2", "cost 'forward' given twice"),
        ("forward=-1", r"forward=-1.0: costs must be finite numbers >= 0, got -1.0"),
        ("forward=inf", "costs must be finite numbers >= 0, got inf"),
    ],
)
def test_parse_errors_name_the_bad_key_or_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Costs.parse(text)


def test_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        Costs(forward=-1, step=(1, "x"))  # type: ignore[arg-type]
    assert "forward=-1" in str(caught.value) and "step=(1, 'x')" in str(caught.value)


def test_per_stage_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        Costs(forward=(1, 2), step=(1, 2, 3))
    with pytest.raises(ValueError, match="forward has 2 values but the schedule has 3 stages"):
        Costs(forward=(1, 2)).per_stage(3)


def test_to_dict() -> None:
    assert Costs(forward=(1, 2)).to_dict() == {
        "forward": [1.0, 2.0],
        "backward": None,
        "backward_input": None,
        "backward_weight": None,
        "communication": 0.0,
        "send": 0.0,
        "reduce": 0.0,
        "step": 0.0,
        "unshard": 0.0,
    }


def test_a_send_keeps_the_sender_busy_and_delays_the_message() -> None:
    from pipetrain.schedule import build_schedule, simulate

    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    free = simulate(schedule, Costs(forward=1, backward=2)).makespan
    costly = simulate(schedule, Costs(forward=1, backward=2, send=0.25)).makespan
    # 2 activation sends + 2 gradient sends; on the critical path: rank 0's first send,
    # both of rank 1's gradient sends' effect on rank 0, ...: the makespan grows
    assert costly > free
    timeline = simulate(schedule, Costs(forward=1, backward=2, send=0.25)).timeline
    sends = [t for t in timeline if str(t.action) in ("0SF0", "1SB1")]
    assert all(abs((t.end - t.start) - 0.25) < 1e-12 for t in sends)
