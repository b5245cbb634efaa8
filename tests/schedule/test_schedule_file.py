from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.schedule import (
    SCHEDULE_NAMES,
    build_schedule,
    complete_lowering,
    default_stages_per_rank,
    dualpipe_v,
    find_problems,
    load_schedule,
    parse_schedule,
)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_what_print_gives_reads_back_the_same(name: str) -> None:
    for lowered in (False, True):
        schedule = build_schedule(name, num_ranks=3, num_microbatches=6,
                                  stages_per_rank=default_stages_per_rank(name),
                                  communication=lowered, optimizer_step=lowered and name != "forward",
                                  reduce=lowered and name != "forward")
        back = parse_schedule(str(schedule), name=schedule.name)
        assert back == schedule


def test_plain_lines_comments_and_commas(tmp_path: Path) -> None:
    path = tmp_path / "plain.sched"
    path.write_text("# a comment\n\n0F0, 0F1 0B0 0B1  # stage 0\n1F0 1B0 1F1 1B1\n")
    schedule = load_schedule(path)
    assert schedule.name == "plain" and schedule.num_microbatches == 2
    assert str(schedule) == "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"


def test_placement_is_read_from_the_lines() -> None:
    schedule = parse_schedule(str(dualpipe_v(3, 6)))
    assert schedule.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert find_problems(schedule) == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("rank 1: 0F0 0B0", r"line 1: 'rank 1' where rank 0 was expected; fix: one line per rank"),
        ("rank 0: 0F0 0Q0", r"line 1: unknown op 'Q' in action '0Q0'"),
        ("rank 0: 0F0 0B0\nrank 1: 0F1 1F0", r"stage 0 has actions on ranks \[0, 1\] \(lines 1, 2\)"),
        ("rank 0: 0F0 0B0 2F0 2B0", r"stages \[1\] have no action; fix: number the stages 0..1"),
        ("rank 0: 0F0 0B0\nrank 1:", r"ranks \[1\] have no action"),
        ("# nothing\n", r"no actions: write one line per rank"),
        ("rank 0: 0F 0B0", r"line 1: action '0F': op F needs a micro-batch index"),
    ],
)
def test_bad_text_names_the_line_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_schedule(text, name="bad")


def test_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        parse_schedule("rank 0: 0F0 0Z0\nrank 5: 1F0 1B0")
    assert "line 1: unknown op 'Z'" in str(caught.value)
    assert "line 2: 'rank 5' where rank 1 was expected" in str(caught.value)


def test_complete_lowering_adds_only_what_is_missing() -> None:
    bare = parse_schedule("rank 0: 0F0 0B0\nrank 1: 1F0 1B0", name="gpipe")
    full = complete_lowering(bare)
    assert full == build_schedule("gpipe", num_ranks=2, num_microbatches=1, optimizer_step=True,
                                  reduce=True)
    with_messages = parse_schedule("rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0 1SB0", name="gpipe")
    assert complete_lowering(with_messages) == full
    stepped = parse_schedule("rank 0: 0F0 0B0 0STEP\nrank 1: 1F0 1B0 1STEP")
    assert str(complete_lowering(stepped)) == (
        "rank 0: 0F0 0SF0 0RB0 0B0 0STEP\nrank 1: 1RF0 1F0 1B0 1SB0 1STEP")
    forward = parse_schedule("rank 0: 0F0\nrank 1: 1F0")
    assert str(complete_lowering(forward)) == "rank 0: 0F0 0SF0\nrank 1: 1RF0 1F0"


def test_complete_lowering_refuses_half_an_optimizer_step() -> None:
    with pytest.raises(ValueError, match=r"has REDUCE actions but no STEP: its gradients would never "
                                         r"be applied; fix: end each rank with a STEP"):
        complete_lowering(parse_schedule("rank 0: 0F0 0B0 0REDUCE", name="half"))
    with pytest.raises(ValueError, match=r"steps some stages but not 1STEP on rank 1; fix: a STEP "
                                         r"for every stage"):
        complete_lowering(parse_schedule("rank 0: 0F0 0B0 0STEP\nrank 1: 1F0 1B0", name="half"))
