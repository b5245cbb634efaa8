"""Counts in the words users read: ``1 stage``, never ``1 stages`` (a run on one stage,
a schedule on one rank, a plan on one worker)."""

from __future__ import annotations

import pytest

from pipetrain.cli.run_config import RunConfig
from pipetrain.counts import count_of
from pipetrain.plan.topology import Topology
from pipetrain.schedule import Costs


@pytest.mark.parametrize("number, noun, words", [
    (0, "stage", "0 stages"), (1, "stage", "1 stage"), (2, "micro-batch", "2 micro-batches"),
    (1, "micro-batch", "1 micro-batch"), (3, "process", "3 processes"),
    (2, "entry", "2 entries"),
])
def test_count_of(number: int, noun: str, words: str) -> None:
    plural = "entries" if noun == "entry" else None
    assert count_of(number, noun, plural) == words


def test_one_of_a_kind_reads_singular() -> None:
    assert RunConfig(stages=1, microbatches=1).describe() == "1f1b, 1 stage x 1 replica, 1 micro-batch"
    assert Topology.flat(1, 1e9).describe() == "1 worker at 1e+09 B/s"
    with pytest.raises(ValueError, match=r"forward has 2 values but the schedule has 1 stage$"):
        Costs(forward=(1.0, 2.0)).per_stage(1)
