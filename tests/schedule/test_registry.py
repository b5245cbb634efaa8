from __future__ import annotations

import pytest

from pipetrain.schedule import (
    SCHEDULE_ALIASES,
    SCHEDULE_NAMES,
    V_SCHEDULES,
    add_communication,
    add_optimizer_step,
    build_schedule,
    canonical_name,
    default_stages_per_rank,
    find_problems,
    format_actions,
    get_generator,
    interleaved_1f1b,
    one_f_one_b,
    parse_actions,
    schedule_placement,
    stages_per_rank_range,
    v_placement,
    zb_h1,
)

from .helpers import sizes


def _admitted(name: str) -> list[tuple[int, int, int]]:
    """(K, M, V) of the grid that ``name`` admits."""
    if name == "interleaved-1f1b":
        return [(k, m, v) for k, m in sizes(min_microbatches_per_rank=1) for v in (2, 3)]
    if name == "looped-bfs":
        return [(k, m, v) for k, m in sizes() for v in (2, 3)]
    if name in V_SCHEDULES:
        return [(k, m, 2) for k, m in sizes()]
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
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1",
                              "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v", "pipedream", "2bw",
                              "forward")
    assert {alias: canonical_name(alias) for alias in SCHEDULE_ALIASES} == {
        "pipedream-flush": "1f1b",
        "interleaved": "interleaved-1f1b",
        "zero-bubble": "zb-h1",
        "bfs": "looped-bfs",
        "zbv": "zb-v",
        "vhalf": "v-half",
        "vmin": "v-min",
        "dualpipev": "dualpipe-v",
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
        match=r"unknown schedule 'gpip'; known schedules: gpipe, 1f1b, interleaved-1f1b, "
        r"looped-bfs, zb-h1, zb-h2, zb-v, v-half, v-min, dualpipe-v, pipedream, 2bw, forward",
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


def test_placements_and_stages_per_rank() -> None:
    assert schedule_placement("zb-v", 3, 2) == v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert schedule_placement("dualpipev", 2, 2) == (0, 1, 1, 0)
    assert schedule_placement("looped-bfs", 2, 3) == (0, 1, 0, 1, 0, 1)
    assert [default_stages_per_rank(n) for n in SCHEDULE_NAMES] == [1, 1, 2, 2, 1, 1, 2, 2, 2, 2, 1, 1, 1]
    assert stages_per_rank_range("bfs") == (2, None)
    for name in V_SCHEDULES:
        built = build_schedule(name, num_ranks=3, num_microbatches=6, stages_per_rank=2)
        assert built.stage_to_rank == v_placement(3)


def test_forward_with_the_v_placement_of_its_training_schedule() -> None:
    evaluation = build_schedule("forward", num_ranks=2, num_microbatches=2, stages_per_rank=2,
                                placement=v_placement(2))
    assert evaluation.stage_to_rank == (0, 1, 1, 0)
    assert format_actions(evaluation.actions[1]) == "1RF0 1F0 1RF1 1F1 2F0 2SF0 2F1 2SF1"


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("gpipe", {"stages_per_rank": 2}, "gpipe has one stage per rank, got stages_per_rank=2"),
        ("zb-h1", {"stages_per_rank": 3}, "zb-h1 has one stage per rank, got stages_per_rank=3"),
        ("interleaved", {}, "interleaved-1f1b needs stages_per_rank >= 2, got 1"),
        ("looped-bfs", {}, "looped-bfs needs stages_per_rank >= 2, got 1"),
        (
            "zb-v",
            {"stages_per_rank": 3},
            r"zb-v places exactly 2 stages per rank \(a V: rank r holds stages r and 2K-1-r\), "
            r"got stages_per_rank=3; fix: stages_per_rank=2",
        ),
        ("dualpipe-v", {}, "dualpipe-v places exactly 2 stages per rank .* got stages_per_rank=1"),
        ("zb-h2", {"stages_per_rank": 2}, "zb-h2 has one stage per rank, got stages_per_rank=2"),
        ("1f1b", {"placement": (0, 1)}, r"placement=\(0, 1\) is for 'forward' only"),
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
