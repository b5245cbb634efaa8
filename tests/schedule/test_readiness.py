"""Readiness-driven order and jitter: the fixed order replays the simulator, the ready
order keeps each stage's order and the memory bound, never stalls, and gains where it can."""

from __future__ import annotations

import pytest

from pipetrain.schedule import ASYNC_SCHEDULES, TRAINING_SCHEDULES, build_schedule, simulate
from pipetrain.schedule.actions import Op, parse_actions
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.jitter import Jitter, execute_order
from pipetrain.schedule.program import Schedule
from pipetrain.schedule.readiness import ReadyOrder, check_order

SYNC = [name for name in TRAINING_SCHEDULES if name not in ASYNC_SCHEDULES]
COSTS = Costs(communication=0.05, reduce=0.5, step=0.3)


def _schedule(name: str, ranks: int, microbatches: int) -> Schedule:
    per_rank = 2 if name in ("interleaved-1f1b", "looped-bfs", "zb-v", "v-half", "v-min",
                             "dualpipe-v") else 1
    return build_schedule(name, num_ranks=ranks, num_microbatches=microbatches,
                          stages_per_rank=per_rank, communication=False, optimizer_step=True,
                          reduce=True)


def _order_per_rank(timeline: tuple) -> dict[int, list]:  # type: ignore[type-arg]
    ranks: dict[int, list] = {}  # type: ignore[type-arg]
    for t in sorted(timeline, key=lambda t: (t.rank, t.start, t.end)):
        ranks.setdefault(t.rank, []).append(t.action)
    return ranks


@pytest.mark.parametrize("name", SYNC)
def test_the_fixed_order_replays_the_simulator(name: str) -> None:
    for ranks, microbatches in ((2, 4), (4, 8)):
        schedule = _schedule(name, ranks, microbatches)
        costs = COSTS.per_stage(schedule.num_stages)
        expected = sorted((t.rank, str(t.action), round(t.start, 9), round(t.end, 9))
                          for t in simulate(schedule, COSTS).timeline)
        got = sorted((t.rank, str(t.action), round(t.start, 9), round(t.end, 9))
                     for t in execute_order(schedule, costs, order="fixed").timeline)
        assert got == expected


@pytest.mark.parametrize("name", SYNC)
def test_the_ready_order_keeps_each_stage_in_order_and_the_memory_bound(name: str) -> None:
    for ranks, microbatches in ((2, 8), (4, 8)):
        schedule = _schedule(name, ranks, microbatches)
        costs = COSTS.per_stage(schedule.num_stages)
        peaks = simulate(schedule, COSTS).peak_activations
        for seed in range(4):
            jitter = Jitter(delay=0.8, seed=seed, link=0.3 * (seed % 2))
            ran = _order_per_rank(execute_order(schedule, costs, order="ready", jitter=jitter,
                                                patience=0.0).timeline)
            for r, listed in enumerate(schedule.actions):
                assert sorted(map(str, ran[r])) == sorted(map(str, listed))
                for kinds in ((Op.FORWARD,), (Op.BACKWARD, Op.BACKWARD_INPUT),
                              (Op.BACKWARD_WEIGHT,), (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP)):
                    for j in range(schedule.num_stages):
                        def mine(actions: list, j: int = j, kinds: tuple = kinds) -> list:  # type: ignore[type-arg]
                            return [a for a in actions if a.stage == j and a.op in kinds]
                        assert mine(ran[r]) == mine(list(listed)), (name, r, j, kinds)
                held = peak = 0
                for a in ran[r]:
                    held += (a.op is Op.FORWARD) - (a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT))
                    peak = max(peak, held)
                assert peak <= peaks[r], (name, seed, r)


def test_a_late_message_lets_a_ready_backward_go_first() -> None:
    # rank 1 holds stages 1 and 2; stage 1's second forward input is late (stage 0 is
    # three times slower), while stage 2's backward of micro-batch 0 can run
    schedule = Schedule(name="toy", num_microbatches=2, stage_to_rank=(0, 1, 1), actions=(
        tuple(parse_actions("0F0 0F1 0B0 0B1")),
        tuple(parse_actions("1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"))))
    costs = Costs(forward=(3, 1, 1)).per_stage(3)
    fixed = execute_order(schedule, costs, order="fixed")
    ready = execute_order(schedule, costs, order="ready")  # waits half of 1F1 for it first
    assert [str(a) for a in _order_per_rank(fixed.timeline)[1]] == \
        "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1".split()
    assert [str(a) for a in _order_per_rank(ready.timeline)[1]][:3] == ["1F0", "2F0", "2B0"]
    assert (max(t.end for t in ready.timeline), max(t.end for t in fixed.timeline)) == (23.5, 24)


def test_patience_waits_for_a_message_about_to_arrive() -> None:
    schedule = _schedule("zb-h1", 4, 8)
    costs = Costs(communication=0.05).per_stage(4)
    fixed = max(t.end for t in execute_order(schedule, costs, order="fixed").timeline)
    eager = max(t.end for t in execute_order(schedule, costs, order="ready", patience=0.0).timeline)
    patient = max(t.end for t in execute_order(schedule, costs, order="ready").timeline)
    assert patient == pytest.approx(fixed)
    assert eager >= fixed  # without patience a B jumped in front of a nearly arrived F


def test_jitter_is_seeded_per_action_and_checked() -> None:
    a, b = parse_actions("1F0 1F1")
    jitter = Jitter(delay=0.4, ranks=(1, 2), seed=7)
    assert jitter.factor(1, a) == Jitter(delay=0.4, ranks=(1,), seed=7).factor(1, a)
    assert jitter.factor(1, a) != jitter.factor(1, b) and jitter.factor(0, a) == 1.0
    assert all(1.0 <= Jitter(delay=0.4, seed=s).factor(1, a) < 1.4 for s in range(50))
    assert Jitter.parse("delay=0.2,ranks=0:3,link=1,seed=2") == Jitter(
        delay=0.2, ranks=(0, 3), link=1.0, seed=2)
    with pytest.raises(ValueError, match="delay=-1"):
        Jitter(delay=-1)
    with pytest.raises(ValueError, match="ranks=x"):
        Jitter.parse("ranks=x")
    with pytest.raises(ValueError, match=r"order='random'.*fixed, ready"):
        check_order("random")
    with pytest.raises(ValueError, match="not one that may run next"):
        ReadyOrder(parse_actions("0F0 0F1")).done(b)


def test_the_straggler_table_of_the_docs_is_what_the_simulator_gives() -> None:
    from pathlib import Path

    from pipetrain.schedule.costs import model_costs

    text = (Path(__file__).parents[2] / "docs" / "schedules.md").read_text()
    section = text.split("## Stragglers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| schedule")]
    assert len(rows) == 5
    for cells in rows:
        name, *shown = (c.strip() for c in cells)
        schedule = _schedule(name, 4, 16)
        costs = model_costs(Costs(communication=0.05), num_ranks=4,
                            stage_layers=(1,) * schedule.num_stages).per_stage(schedule.num_stages)
        got = [max(t.end for t in execute_order(schedule, costs, order="fixed").timeline)]
        for jitter in (Jitter(delay=0.4, ranks=(1,)), Jitter(delay=0.4)):
            got += [max(t.end for t in execute_order(schedule, costs, order=o, jitter=jitter)
                        .timeline) for o in ("fixed", "ready")]
        assert [f"{v:.1f}" for v in got] == shown, name
