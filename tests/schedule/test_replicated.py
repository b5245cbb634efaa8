"""Replicated stages: every replica layout validates, micro-batches go round-robin, and a
replicated stage carries its share of the work (schedule/replicated.py)."""

from __future__ import annotations

import itertools
import math

import pytest

from pipetrain.schedule import Op, build_schedule, simulate, validate
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.replicated import replica_ranks, replicated_pipeline, uniform_replicas

from .helpers import full_activation_peaks

LAYOUTS = [r for k in (1, 2, 3) for r in itertools.product((1, 2, 3), repeat=k)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "forward"])
def test_every_replica_layout_validates_and_routes_round_robin(name: str) -> None:
    for replicas, total in itertools.product(LAYOUTS, (1, 2, 3, 5, 8)):
        if total < max(replicas) and name != "forward":
            continue
        schedule = build_schedule(name, num_ranks=len(replicas), num_microbatches=total,
                                  replicas=replicas, optimizer_step=name != "forward",
                                  reduce=name != "forward")
        assert schedule.num_ranks == sum(replicas)
        assert schedule.num_microbatches == total
        groups = replica_ranks(replicas)
        assert [schedule.ranks_of(j) for j in range(len(replicas))] == list(groups)
        for r, actions in enumerate(schedule.actions):
            for a in actions:
                if a.op.is_compute:
                    assert r == schedule.ranks_of(a.stage)[a.microbatch % replicas[a.stage]], (replicas, a)


def test_one_f_one_b_holds_what_is_in_flight_below_it() -> None:
    """A replica of stage j holds at most ceil(sum(r below j) / r_j) + 1 micro-batches:
    1F1B's K - j with one replica per stage."""
    for replicas in LAYOUTS:
        schedule = replicated_pipeline("1f1b", replicas, 12 * max(replicas))
        peaks = full_activation_peaks(schedule)
        for j, group in enumerate(schedule.replicas):
            bound = math.ceil(sum(replicas[j + 1:]) / replicas[j]) + 1
            assert all(peaks[r] == min(bound, 12 * max(replicas) // replicas[j]) for r in group), (replicas, peaks)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_replica_counts_are_copies_of_the_one_replica_schedule(name: str) -> None:
    for num_stages, num_replicas, per_replica in itertools.product((1, 2, 3), (1, 2, 3), (1, 4)):
        base = build_schedule(name, num_ranks=num_stages, num_microbatches=per_replica,
                              communication=False)
        replicated = replicated_pipeline(name, [num_replicas] * num_stages, per_replica * num_replicas)
        copies = uniform_replicas(
            lambda n, k=num_stages: build_schedule(name, num_ranks=k, num_microbatches=n, communication=False),
            per_replica * num_replicas, num_replicas)
        assert replicated.actions == copies.actions
        assert base.actions == build_schedule(name, num_ranks=num_stages, num_microbatches=per_replica,
                                              communication=False).actions


@pytest.mark.parametrize("name", ["zb-h1", "interleaved-1f1b"])
def test_any_schedule_runs_with_the_same_replica_count_everywhere(name: str) -> None:
    spr = 2 if name == "interleaved-1f1b" else 1
    schedule = build_schedule(name, num_ranks=2, num_microbatches=12, stages_per_rank=spr,
                              replicas=[3, 3], optimizer_step=True, reduce=True)
    assert schedule.num_ranks == 6 and schedule.num_microbatches == 12
    for d in range(3):  # replica d runs micro-batches d, d + 3, ... on every stage
        for r in (d, 3 + d):
            assert {a.microbatch % 3 for a in schedule.actions[r] if a.op.is_compute} == {d}


def test_a_replicated_slow_stage_keeps_up() -> None:
    """Stage 1 costs twice stage 0: with two replicas of it (1-2) the step takes about
    what an even pipeline of two equal stages takes, and clearly less than 1-1."""
    costs = Costs(forward=(1.0, 2.0))
    one_one = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=16), costs).makespan
    one_two = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=16, replicas=[1, 2]),
                       costs).makespan
    # a small evaluation batch leaves replicas idle
    small = build_schedule("forward", num_ranks=2, num_microbatches=1, replicas=[2, 2])
    assert [len(acts) for acts in small.actions] == [2, 0, 2, 0]
    assert one_two < 0.6 * one_one
    assert one_two < 16 * 3 + 2 * 6  # the first stage's work plus a fill and a drain


def test_layouts_that_cannot_run_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"zb-h1.*cannot run replicated stages with different"):
        build_schedule("zb-h1", num_ranks=2, num_microbatches=4, replicas=[2, 1])
    with pytest.raises(ValueError, match=r"1 micro-batches cannot train 2 replicas"):
        build_schedule("zb-h1", num_ranks=2, num_microbatches=1, replicas=[2, 2])
    with pytest.raises(ValueError, match=r"more replicas than the 2 micro-batches.*num_microbatches >= 3"):
        replicated_pipeline("1f1b", [1, 3], 2)
    with pytest.raises(ValueError, match=r"replicas \[2\] has 1 entries for 2 ranks"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=4, replicas=[2])
    with pytest.raises(ValueError, match="needs one stage per rank"):
        build_schedule("interleaved-1f1b", num_ranks=2, num_microbatches=4, stages_per_rank=2,
                       replicas=[2, 1])


def test_the_validator_names_a_micro_batch_on_the_wrong_replica() -> None:
    schedule = replicated_pipeline("gpipe", [1, 2], 2)
    swapped = schedule.replace_actions([schedule.actions[0], schedule.actions[2], schedule.actions[1]])
    with pytest.raises(ValueError, match="which its replica on rank 2 runs, not rank 1"):
        validate(swapped)
    assert all(a.op is not Op.OPTIMIZER_STEP for acts in schedule.actions for a in acts)
