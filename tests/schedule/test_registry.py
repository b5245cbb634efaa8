from __future__ import annotations

import pytest

from pipetrain.schedule import (
    SCHEDULE_ALIASES,
    SCHEDULE_NAMES,
    add_communication,
    add_optimizer_step,
    build_schedule,
    canonical_name,
    find_problems,
    format_actions,
    get_generator,
    interleaved_1f1b,
    one_f_one_b,
    parse_actions,
    zb_h1,
)

from .helpers import sizes


def _admitted(name: str) -> list[tuple[int, int, int]]:
    """(K, M, V) of the grid that ``name`` admits."""
    if name == "interleaved-1f1b":
        return [(k, m, v) for k, m in sizes(min_microbatches_per_rank=1) for v in (2, 3)]
    if name == "forward":
        return [(k, m, v) for k, m in sizes() for v in (1, 2)]
    if name == "2bw":  # a step's micro-batches reach a stage after the last step's
        return [(k, m, 1) for k, m in sizes() if m >= k - 1]
    return [(k, m, 1) for k, m in sizes()]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_validates_on_the_grid(name: str) -> None:
    """K in 1..8, M in 1..16: compute-only, and lowered with messages (plus the
    optimizer step and the all-reduce for training schedules)."""
    for num_ranks, num_microbatches, stages_per_rank in _admitted(name):
        options = dict(
            num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=stages_per_rank
        )
        build_schedule(name, communication=False, **options)  # type: ignore[arg-type]
        training = name != "forward"
        build_schedule(
            name, communication=True, optimizer_step=training, reduce=training, **options
        )  # type: ignore[arg-type]


@pytest.mark.parametrize("generator", [one_f_one_b, zb_h1, interleaved_1f1b])
def test_optimizer_step_without_communication_validates(generator: object) -> None:
    for num_ranks, num_microbatches in [(1, 1), (2, 5), (4, 4), (4, 9)]:
        schedule = generator(num_ranks, num_microbatches)  # type: ignore[operator]
        assert find_problems(add_optimizer_step(schedule, reduce=True)) == []
        assert find_problems(add_optimizer_step(add_communication(schedule), reduce=False)) == []


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_compact_form_round_trips(name: str) -> None:
    for num_ranks, num_microbatches, stages_per_rank in _admitted(name)[::7]:
        schedule = build_schedule(
            name,
            num_ranks=num_ranks,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            optimizer_step=name != "forward",
            reduce=name != "forward",
        )
        for actions in schedule.actions:
            assert tuple(parse_actions(format_actions(actions))) == actions


def test_names_and_aliases() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "forward",
                              "pipedream", "2bw")
    assert {alias: canonical_name(alias) for alias in SCHEDULE_ALIASES} == {
        "pipedream-flush": "1f1b",
        "interleaved": "interleaved-1f1b",
        "zero-bubble": "zb-h1",
        "forward-only": "forward",
        "inference": "forward",
        "pipedream-2bw": "2bw",
    }
    assert canonical_name("ZB_H1") == "zb-h1"
    assert get_generator("pipedream-flush") is one_f_one_b
    assert build_schedule("inference", num_ranks=2, num_microbatches=2).name == "forward"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown schedule 'gpip'; known schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1, forward",
    ):
        build_schedule("gpip", num_ranks=2, num_microbatches=2)


def test_built_schedule_is_lowered_as_asked() -> None:
    bare = build_schedule("1f1b", num_ranks=2, num_microbatches=2, communication=False)
    assert bare == one_f_one_b(2, 2)
    full = build_schedule("1f1b", num_ranks=2, num_microbatches=2, optimizer_step=True, reduce=True)
    assert full == add_optimizer_step(add_communication(bare), reduce=True)


def test_forward_with_virtual_stages() -> None:
    schedule = build_schedule("forward", num_ranks=2, num_microbatches=3, stages_per_rank=2)
    assert schedule.num_ranks == 2 and schedule.num_stages == 4


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("gpipe", {"stages_per_rank": 2}, "gpipe has one stage per rank, got stages_per_rank=2"),
        ("zb-h1", {"stages_per_rank": 3}, "zb-h1 has one stage per rank, got stages_per_rank=3"),
        ("interleaved", {}, "interleaved-1f1b needs stages_per_rank >= 2, got 1"),
        (
            "interleaved",
            {"stages_per_rank": 2, "num_microbatches": 1},
            "needs at least num_ranks micro-batches",
        ),
        ("1f1b", {"num_ranks": 0}, "num_ranks must be at least 1, got 0"),
        ("1f1b", {"reduce": True}, "reduce=True needs optimizer_step=True"),
        ("forward", {"optimizer_step": True}, "is forward-only"),
    ],
)
def test_bad_options_name_the_value(name: str, options: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"num_ranks": 2, "num_microbatches": 4, **options}
    with pytest.raises(ValueError, match=message):
        build_schedule(name, **arguments)  # type: ignore[arg-type]
