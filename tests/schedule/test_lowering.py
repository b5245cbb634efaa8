from __future__ import annotations

import pytest

from pipetrain.schedule import (
    Action,
    Costs,
    Op,
    Schedule,
    add_communication,
    add_fsdp_actions,
    add_optimizer_step,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    simulate,
    zb_h1,
)


def test_messages_cross_ranks_only_right_around_the_compute() -> None:
    assert str(add_communication(interleaved_1f1b(2, 2))) == (
        "rank 0: 0F0 0SF0 0F1 0SF1 2RF0 2F0 2SF0 2RF1 2F1 2SF1 2RB0 2B0 2SB0 2RB1 2B1 2SB1 "
        "0RB0 0B0 0RB1 0B1\n"
        "rank 1: 1RF0 1F0 1SF0 1RF1 1F1 1SF1 3RF0 3F0 3B0 3SB0 3RF1 3F1 3B1 3SB1 1RB0 1B0 1SB0 "
        "1RB1 1B1 1SB1"
    )


def test_split_backward_sends_after_i_not_w() -> None:
    lowered = add_communication(zb_h1(2, 1))
    assert str(lowered) == "rank 0: 0F0 0SF0 0RB0 0I0 0W0\nrank 1: 1RF0 1F0 1I0 1SB0 1W0"


def test_same_timing_as_the_implicit_messages() -> None:
    costs = Costs(forward=1, backward=2, communication=0.25)
    schedule = interleaved_1f1b(4, 8)
    implicit, explicit = simulate(schedule, costs), simulate(add_communication(schedule), costs)
    assert explicit.makespan == implicit.makespan
    compute = [
        (t.rank, t.action, t.start, t.end) for t in explicit.timeline if t.action.op.is_compute
    ]
    assert compute == [(t.rank, t.action, t.start, t.end) for t in implicit.timeline]


def test_one_rank_needs_no_messages() -> None:
    schedule = interleaved_1f1b(1, 2, stages_per_rank=3)
    assert add_communication(schedule) == schedule


def test_communication_is_added_once() -> None:
    with pytest.raises(
        ValueError, match=r"already has communication actions \(rank 0, position 1: 0SF0"
    ):
        add_communication(add_communication(gpipe(2, 1)))


def test_reduce_after_last_backward_and_its_send_then_steps_in_stage_order() -> None:
    lowered = add_optimizer_step(add_communication(interleaved_1f1b(2, 2)), reduce=True)
    rank0 = [str(a) for a in lowered.actions[0]]
    # stage 2's last backward is 2B1 (then its send); stage 0's is 0B1, at the end
    assert rank0[rank0.index("2B1") + 1 : rank0.index("2B1") + 3] == ["2SB1", "2REDUCE"]
    assert rank0[-4:] == ["0B1", "0REDUCE", "0STEP", "2STEP"]


def test_reduce_follows_the_last_w_of_a_split_backward() -> None:
    lowered = add_optimizer_step(zb_h1(3, 4), reduce=True)
    for actions in lowered.actions:
        last_w = max(p for p, a in enumerate(actions) if a.op is Op.BACKWARD_WEIGHT)
        assert actions[last_w + 1].op is Op.REDUCE_GRAD
        assert actions[-1].op is Op.OPTIMIZER_STEP


def test_steps_without_reduce() -> None:
    lowered = add_optimizer_step(gpipe(2, 1), reduce=False)
    assert lowered.actions[1][-1] == Action(1, Op.OPTIMIZER_STEP)
    assert not any(a.op is Op.REDUCE_GRAD for acts in lowered.actions for a in acts)


def test_forward_only_has_nothing_to_step() -> None:
    with pytest.raises(ValueError, match="'forward' is forward-only"):
        add_optimizer_step(forward_only(2, 2), reduce=True)


def test_step_is_added_once() -> None:
    with pytest.raises(ValueError, match="already has REDUCE or STEP actions"):
        add_optimizer_step(add_optimizer_step(gpipe(2, 1), reduce=False), reduce=False)


def _fsdp(schedule_name: str, ranks: int, microbatches: int, **options: int) -> Schedule:
    return add_fsdp_actions(build_schedule(schedule_name, num_ranks=ranks, num_microbatches=microbatches,
                                           optimizer_step=True, reduce=True, **options))


def test_fsdp_gathers_each_stage_once_a_compute_action_ahead_and_frees_it_after_its_reduce() -> None:
    lowered = _fsdp("interleaved-1f1b", 2, 4, stages_per_rank=2)
    rank0 = [str(a) for a in lowered.actions[0]]
    assert [a for a in rank0 if "SHARD" in a] == ["0UNSHARD", "2UNSHARD", "2RESHARD", "0RESHARD"]
    assert rank0[0] == "0UNSHARD"
    # stage 2's first action is its receive; its gather starts before the forward ahead of it
    first = rank0.index("2RF0")
    ahead = max(p for p in range(first) if lowered.actions[0][p].op.is_compute)
    assert rank0.index("2UNSHARD") == ahead - 1  # right before that forward
    for stage in (0, 2):
        assert rank0.index(f"{stage}RESHARD") == rank0.index(f"{stage}REDUCE") + 1
        assert rank0.index(f"{stage}RESHARD") < rank0.index(f"{stage}STEP")
    # replicas: each gathers once, whatever its share of the micro-batches
    replicated = _fsdp("1f1b", 2, 3, replicas=(2, 2))
    for actions in replicated.actions:
        assert sum(a.op is Op.UNSHARD for a in actions) == 1 == sum(a.op is Op.RESHARD for a in actions)


def test_fsdp_actions_are_added_once_and_need_the_reduce() -> None:
    with pytest.raises(ValueError, match="already has UNSHARD or RESHARD"):
        add_fsdp_actions(_fsdp("gpipe", 2, 2))
    with pytest.raises(ValueError, match=r"rank 0 has no REDUCE for stage\(s\) \[0\].*reduce=True"):
        add_fsdp_actions(add_optimizer_step(gpipe(2, 2), reduce=False))
    forward = add_fsdp_actions(forward_only(2, 2))
    assert str(forward).splitlines()[0] == "rank 0: 0UNSHARD 0F0 0F1 0RESHARD"


def test_the_simulator_waits_for_a_gather_and_hides_one_started_ahead() -> None:
    plain = simulate(_fsdp("1f1b", 2, 4), Costs(forward=1.0))
    gathering = simulate(_fsdp("1f1b", 2, 4), Costs(forward=1.0, unshard=0.5))
    # rank 0's first forward waits for its gather; rank 1's gather overlaps its first wait
    assert gathering.makespan == plain.makespan + 0.5
    first = {(t.rank, str(t.action)): t for t in gathering.timeline}
    assert first[(0, "0UNSHARD")].end == 0.5 == first[(0, "0F0")].start
    # interleaved: stage 2's gather runs under stage 0's forwards and costs nothing
    two = {cost: simulate(_fsdp("interleaved-1f1b", 2, 4, stages_per_rank=2),
                          Costs(forward=1.0, unshard=cost)).makespan for cost in (0.0, 0.5)}
    assert two[0.5] == two[0.0] + 0.5  # only the first stage's gather is exposed
