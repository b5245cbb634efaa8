"""``pipetrain train``'s messages about the layout (``--balance``, ``--stages``,
``--virtual``, ``--layers``) name the bad value and give fixes that the run takes: each
fix offered is applied and checked again (it used to offer ``--balance 3,3`` to a run of
4 layers, not say that a 0 was the problem, and blame the layer count for a wrong
``--virtual``)."""

from __future__ import annotations

import argparse
import re

import pytest

from pipetrain.cli.main import build_parser
from pipetrain.cli.train_checks import prepare

TINY = ["--width", "16", "--heads", "2", "--context", "16", "--batch-size", "8",
        "--microbatches", "4", "--steps", "2", "--sample-bytes", "0"]


def _problems(argv: list[str]) -> list[str]:
    args: argparse.Namespace = build_parser().parse_args(["train", *TINY, *argv])
    args.given = set(getattr(args, "given", ()))
    _, _, problems = prepare(args)
    return problems


def _fixes(line: str) -> list[list[str]]:
    """Each alternative after 'fix: ' as the flags it sets (parenthesized notes left out)."""
    alternatives = line.split("fix: ", 1)[1].split(", or ")
    fixes = []
    for alternative in alternatives:
        alternative = re.sub(r"\([^)]*\)", "", alternative)
        flags = re.findall(r"(--[a-z-]+) (\S+)", alternative)
        if flags:
            fixes.append([part for name, value in flags for part in (name, value.rstrip(",;"))])
    return fixes


def _apply(argv: list[str], fix: list[str]) -> list[str]:
    names = set(fix[0::2])
    kept: list[str] = []
    skip = False
    for part in argv:
        if skip:
            skip = False
            continue
        name = part.split("=", 1)[0]
        if name in names:
            skip = "=" not in part
            continue
        kept.append(part)
    return kept + fix


def _only_problem(argv: list[str]) -> str:
    problems = [p for p in _problems(argv) if not p.startswith("--out")]
    assert len(problems) == 1, problems
    return problems[0]


def _every_fix_works(argv: list[str], line: str, *, count: int) -> None:
    fixes = [fix for fix in _fixes(line) if fix != ["--balance", "auto"]]
    assert len(fixes) == count, (line, fixes)
    for fix in fixes:
        assert _problems(_apply(argv, fix)) == [], (line, fix)


@pytest.mark.parametrize(("argv", "phrases", "count"), [
    # the zero entry named, and an example of the run's 2 stages and 4 layers
    (["--layers", "2", "--balance", "0,4"],
     ["--balance '0,4' must be 'auto' or layers per stage, each at least 1: stage 0 gets 0",
      "fix: --balance 2,2 (2 stages of the run's 4 layers"], 1),
    (["--balance=-1,7"], ["stage 0 gets -1", "fix: --balance 3,3"], 1),
    (["--balance", "3,3,0"], ["stage 2 gets 0", "fix: --balance 3,3"], 1),
    (["--balance", "a,b"], ["'a', 'b' are not", "fix: --balance 3,3"], 1),
    (["--layers", "1", "--balance", "1,1,1,1"], ["fix: 2 numbers adding up to 3, e.g. --balance 2,1"], 1),
    # too many entries: the run's count in the example, or the stages that take them
    (["--balance", "2,2,2"],
     ["--balance 2,2,2 gives 3 stages of 6 layers, but the run has 2 stages",
      "fix: 2 numbers adding up to 6, e.g. --balance 3,3, or --stages 3"], 2),
    (["--balance", "2,2"], ["e.g. --balance 3,3, or --layers 2"], 2),
    (["--schedule", "interleaved-1f1b", "--balance", "3,3"],
     ["the run has 4 stages", "e.g. --balance 2,2,1,1, or --stages 1 (with --virtual 2"], 2),
    # a wrong --virtual is the cause, not the layers: with --virtual 2 4 stages fit 4 layers
    (["--schedule", "zb-v", "--virtual", "3", "--layers", "2"],
     ["schedule 'zb-v' places exactly 2 stages per rank", "got --virtual 3; fix: --virtual 2"], 1),
    # both: the line says zb-v's 2 stages per rank, and fixes both
    (["--schedule", "zb-v", "--virtual", "3", "--layers", "1"],
     ["more stages than layers: --schedule zb-v runs 2 stages per rank (not --virtual 3), so "
      "--stages 2 makes 4 stages for 3 layers",
      "fix: --virtual 2 --stages 1, or --virtual 2 --layers 2"], 2),
    (["--schedule", "interleaved-1f1b", "--virtual", "1", "--layers", "1"],
     ["runs 2 stages per rank (not --virtual 1)"], 2),
    (["--schedule", "interleaved-1f1b", "--virtual", "4"],
     ["--stages 2 x --virtual 4 = 8 stages for 6 layers",
      "fix: --stages 1, or --virtual 3, or --layers 6"], 3),
    (["--stages", "10"], ["more stages than layers: 10 stages for 6 layers",
                          "fix: --stages 6, or --layers 8"], 2),
    (["--schedule", "dualpipe-v", "--layers", "1"], ["fix: --stages 1, or --layers 2"], 2),
    # --virtual 2 with 1F1B: its own line; the balance fits the run's 3 stages
    (["--stages", "3", "--virtual", "2", "--balance", "2,2,2"],
     ["--virtual 2 needs an interleaved schedule", "or --virtual 1"], 2),
])
def test_layout_mistakes_name_the_value_and_fixes_that_work(
    argv: list[str], phrases: list[str], count: int
) -> None:
    line = _only_problem(argv)
    for phrase in phrases:
        assert phrase in line, (phrase, line)
    assert "stages_per_rank" not in line and "num_stages" not in line
    if "needs an interleaved schedule" in line:  # --schedule interleaved-1f1b would need 6 entries
        assert _problems(_apply(argv, ["--virtual", "1"])) == []
        return
    _every_fix_works(argv, line, count=count)
