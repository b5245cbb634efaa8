"""Schedule files: a schedule written as text, one rank per line, read back as a Schedule.

The format is what ``print(schedule)`` gives: one line per rank, ``rank r:`` and then
that rank's actions in their compact form (``0F0 0SF0 1B2 0STEP``). The ``rank r:``
prefix may be left out (line ``r`` is then rank ``r``); blank lines and ``#`` comments
are ignored. Where each stage lives is read from the lines (a stage's actions must all
be on one rank) and the number of micro-batches is the largest one named, plus one.
A file may hold compute actions only (the library adds the sends, receives and the
optimizer step: :func:`~pipetrain.schedule.lowering.complete_lowering`) or everything a
rank runs.

Example of a file (1F1B on two ranks, four micro-batches)::

    # my 1F1B
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""

from __future__ import annotations

import os
import re

from pipetrain.schedule.actions import Action, parse_action
from pipetrain.schedule.program import Schedule

__all__ = ["load_schedule", "parse_schedule"]

_RANK = re.compile(r"^rank\s+(\d+)\s*:(.*)$")


def parse_schedule(text: str, *, name: str = "user") -> Schedule:
    """Read a schedule from its text (see the module's docstring for the format).

    Example:
        >>> s = parse_schedule('''
        ... rank 0: 0F0 0F1 0B0 0B1   # stage 0
        ... rank 1: 1F0 1B0 1F1 1B1
        ... ''', name="toy")
        >>> s.stage_to_rank, s.num_microbatches
        ((0, 1), 2)
        >>> parse_schedule(str(s), name="toy") == s
        True

    Raises:
        ValueError: a line that does not parse, ranks out of order, a stage on two
            ranks, or stages that are not ``0 .. S-1``; every problem at once, each
            naming its line.
    """
    problems: list[str] = []
    lines: list[tuple[int, list[Action]]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _RANK.match(line)
        body = line
        if match is not None:
            body = match.group(2)
            if int(match.group(1)) != len(lines):
                problems.append(
                    f"line {number}: 'rank {match.group(1)}' where rank {len(lines)} was "
                    f"expected; fix: one line per rank, in order from rank 0"
                )
        actions = []
        for token in re.split(r"[\s,]+", body.strip()):
            if not token:
                continue
            try:
                actions.append(parse_action(token))
            except ValueError as error:
                problems.append(f"line {number}: {error}")
        lines.append((number, actions))
    if not lines and not problems:
        problems.append("no actions: write one line per rank, e.g. 'rank 0: 0F0 0B0'")
    stage_to_rank = _placement(lines, problems)
    if problems:
        raise ValueError(f"schedule {name!r}: " + "; ".join(problems))
    microbatches = [a.microbatch for _, acts in lines for a in acts if a.microbatch is not None]
    return Schedule(
        name=name,
        num_microbatches=max(microbatches, default=0) + 1,
        stage_to_rank=stage_to_rank,
        actions=tuple(tuple(acts) for _, acts in lines),
    )


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule file; the schedule is named after the file (without extension).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        ...     _ = f.write("rank 0: 0F0 0B0\\nrank 1: 1F0 1B0\\n")
        >>> load_schedule(f.name).num_stages
        2
        >>> os.remove(f.name)

    Raises:
        OSError: the file cannot be read.
        ValueError: its text is not a schedule (see :func:`parse_schedule`).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    name = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    return parse_schedule(text, name=name)


def _placement(lines: list[tuple[int, list[Action]]], problems: list[str]) -> tuple[int, ...]:
    """The rank of each stage, from the lines its actions are on."""
    ranks_of: dict[int, list[int]] = {}
    for r, (_, actions) in enumerate(lines):
        for a in actions:
            if r not in ranks_of.setdefault(a.stage, []):
                ranks_of[a.stage].append(r)
    for j, ranks in sorted(ranks_of.items()):
        if len(ranks) > 1:
            lines_text = ", ".join(str(lines[r][0]) for r in ranks)
            problems.append(
                f"stage {j} has actions on ranks {ranks} (lines {lines_text}); a schedule "
                f"file gives each stage one rank: move them to one line"
            )
    missing = [j for j in range(max(ranks_of, default=-1) + 1) if j not in ranks_of]
    if missing:
        problems.append(f"stages {missing} have no action; fix: number the stages 0.."
                        f"{len(ranks_of) - 1} without gaps")
    idle = [r for r, (_, actions) in enumerate(lines) if not actions]
    if idle:
        problems.append(f"ranks {idle} have no action; every rank holds a stage")
    return tuple(ranks_of[j][0] for j in sorted(ranks_of)) if not problems else (0,)
