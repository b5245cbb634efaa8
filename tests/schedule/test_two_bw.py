"""PipeDream-2BW: one version per step on every stage (W(t+1) = W(t) - lr * grad(W(t-1))),
one update per stage and step after its last backward, two versions kept, bad input."""

from __future__ import annotations

import pytest

from pipetrain.schedule import (
    AsyncStream,
    Op,
    build_schedule,
    simulate,
    steady_state,
    two_bw,
    versions_held,
)


def test_every_stage_uses_the_version_of_the_step_before() -> None:
    """Micro-batch i of step t = i // M uses version max(t - 1, 0) on every stage, in
    its forward and its backward: the rule does not depend on the number of stages."""
    for num_stages in range(1, 7):
        for count in (max(num_stages - 1, 1), num_stages + 3):
            schedule = two_bw(num_stages, count, num_steps=4)
            for actions in schedule.actions:
                used = {(a.op, a.microbatch): a.version for a in actions
                        if a.op in (Op.FORWARD, Op.BACKWARD)}
                assert used == {(op, i): max(i // count - 1, 0)
                                for op in (Op.FORWARD, Op.BACKWARD) for i in range(4 * count)}


def test_one_update_per_step_after_the_last_backward_of_the_step() -> None:
    for num_stages in range(1, 6):
        count = num_stages + 1
        schedule = two_bw(num_stages, count, num_steps=3)
        for actions in schedule.actions:
            steps = [p for p, a in enumerate(actions) if a.op is Op.OPTIMIZER_STEP]
            assert [actions[p].version for p in steps] == [1, 2, 3]
            assert [actions[p - 1].microbatch for p in steps] == [count - 1, 2 * count - 1, 3 * count - 1]
            assert all(actions[p - 1].op is Op.BACKWARD for p in steps)


def test_two_versions_on_every_stage() -> None:
    for num_stages in range(1, 7):
        for count in (max(num_stages - 1, 1), 2 * num_stages):
            held = versions_held(two_bw(num_stages, count, num_steps=4))
            assert set(held.values()) == {2}, (num_stages, count, held)
    held = versions_held(two_bw(3, 4, replicas=[2, 1, 2], num_steps=4))
    assert set(held.values()) == {2}


def test_validates_with_messages_and_replicas() -> None:
    for num_stages in range(1, 9):
        for count in range(max(num_stages - 1, 1), num_stages + 4):
            build_schedule("2bw", num_ranks=num_stages, num_microbatches=count, num_steps=3)
    for replicas, count in (([2, 1], 4), ([1, 2], 4), ([2, 2], 4), ([3, 1, 2], 12)):
        schedule = build_schedule("2bw", num_ranks=len(replicas), num_microbatches=count,
                                  replicas=replicas, num_steps=3)
        for j, group in enumerate(schedule.replicas):
            for r in group:
                ops = [a.op for a in schedule.actions[r] if a.stage == j]
                assert ops.count(Op.OPTIMIZER_STEP) == 3
                assert ops.count(Op.REDUCE_GRAD) == (3 if len(group) > 1 else 0)


def test_too_few_microbatches_for_two_versions() -> None:
    with pytest.raises(ValueError, match=r"2bw needs at least 3 micro-batches per step on 4 stages "
                                         r".* three weight versions, not two; got 2; fix: num_microbatches >= 3"):
        two_bw(4, 2)
    with pytest.raises(ValueError, match="at least 4 micro-batches"):
        AsyncStream("2bw", [2, 2, 1]).window(2)  # stage 0: 2 replicas x 2 warm-up forwards
    with pytest.raises(ValueError, match=r"multiple of every replica count .* got 3"):
        two_bw(2, 3, replicas=[1, 2])


def test_steady_state_streams_one_microbatch_per_forward_and_backward() -> None:
    schedule = two_bw(4, 8, num_steps=16)
    assert steady_state(schedule, simulate(schedule).timeline).steady == 3.0
