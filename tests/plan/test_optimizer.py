"""The planner on hand-checked cases (``pipetrain/plan/optimizer.py`` and the searches)."""

from __future__ import annotations

import pytest

from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.plan_file import Plan
from pipetrain.plan.profile import Profile
from pipetrain.plan.topology import Topology

from .helpers import chain, graph


def plan(profile: Profile, workers: int, bandwidth: float = 1e9, **options: object) -> Plan:
    return make_plan(profile, PlannerConfig(topology=Topology.flat(workers, bandwidth),
                                            cost_model="pipedream", **options))  # type: ignore[arg-type]


def shape(p: Plan) -> list[tuple[tuple[str | int, ...], int]]:
    return [(stage.nodes, stage.replicas) for stage in p.stages]


def test_chain_straight_balances_the_bottleneck() -> None:
    # 1 2 3 | 4: max(6, 4) = 6 beats 1 2 | 3 4 (7) and 1 | 2 3 4 (9)
    p = plan(chain([1, 2, 3, 4]), 2, straight=True)
    assert shape(p) == [((0, 1, 2), 1), ((3,), 1)] and p.time_per_step == 6.0
    p = plan(chain([1, 2, 3, 4]), 3, straight=True)
    assert shape(p) == [((0, 1), 1), ((2,), 1), ((3,), 1)] and p.time_per_step == 4.0


def test_chain_replicated_uses_data_parallelism_when_it_is_free() -> None:
    # no parameters, no activations: one stage on both workers, 10 / 2
    p = plan(chain([1, 2, 3, 4]), 2)
    assert shape(p) == [((0, 1, 2, 3), 2)] and p.time_per_step == 5.0
    assert p.single_worker_time == 10.0 and p.data_parallel_time == 5.0


def test_diamond_is_cut_where_no_prefix_of_an_order_can() -> None:
    # a -> b -> d, a -> c -> d with b = 5, c = 10, d = 5: the prefixes of a b c d give
    # at best 15 (a b | c d); the cut {a, c} gives 11 | 10
    profile = graph("abcd", [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], [1, 5, 10, 5])
    p = plan(profile, 2, straight=True)
    assert shape(p) == [(("a", "c"), 1), (("b", "d"), 1)] and p.time_per_step == 11.0
    p.check(profile)


@pytest.mark.parametrize(("bandwidth", "expected", "time"), [
    # slow network: sending the 1 GB activation costs 2 s, replicating 1 + 0.1
    (1e9, [((0, 1), 2)], 1.1),
    # fast network: the 0.2 s transfer hides behind 1 s of compute; the all-reduce does not
    (1e10, [((0,), 1), ((1,), 1)], 1.0),
])
def test_replication_flips_with_bandwidth(
    bandwidth: float, expected: list[tuple[tuple[int, ...], int]], time: float
) -> None:
    profile = chain([1, 1], outputs=[10**9, 0], parameters=[5 * 10**7, 5 * 10**7])
    p = plan(profile, 2, bandwidth)
    assert shape(p) == expected and p.time_per_step == pytest.approx(time)


def test_memory_limit_forces_more_stages() -> None:
    # 1 GB of parameters per layer, no activations; memory = held x minibatches in flight
    profile = chain([1, 1, 1, 2], parameters=[10**9] * 4)
    free = plan(profile, 4, 1e18)
    assert shape(free) == [((0, 1, 2, 3), 4)] and free.time_per_step == pytest.approx(1.25)
    assert free.stages[0].memory_per_worker == 4e9
    # within 2 GB the first stage holds one layer on 2 replicas (2 minibatches in flight),
    # the second one layer (2 in flight), the last two layers (1 in flight): 1 + 2 = 3 s
    tight = plan(profile, 4, 1e18, memory_limit=2e9)
    assert shape(tight) == [((0,), 2), ((1,), 1), ((2, 3), 1)]
    assert tight.time_per_step == 3.0
    assert max(s.memory_per_worker or 0 for s in tight.stages) <= 2e9


def test_fewer_workers_only_when_faster() -> None:
    # one layer, 1 GB of parameters at 1 GB/s: 2 replicas cost 0.5 + 1 s, one 1 s
    profile = chain([1], parameters=[10**9])
    all_of_them = plan(profile, 2)
    assert shape(all_of_them) == [((0,), 2)] and all_of_them.time_per_step == 1.5
    fewer = plan(profile, 2, fewer_workers=True)
    assert shape(fewer) == [((0,), 1)] and fewer.time_per_step == 1.0
    assert fewer.workers_used == 1 and fewer.num_workers == 2
    # when all workers are as fast, --fewer-workers still uses them all
    assert plan(chain([1, 2, 3, 4]), 2, fewer_workers=True).workers_used == 2


def test_straight_fewer_workers_may_use_fewer_stages() -> None:
    # every transfer costs 20 s: one stage on one worker (3 s) is fastest
    profile = chain([1, 1, 1], outputs=[10**10] * 3)
    assert plan(profile, 3, straight=True).time_per_step == 20.0
    p = plan(profile, 3, straight=True, fewer_workers=True)
    assert shape(p) == [((0, 1, 2), 1)] and p.time_per_step == 3.0


def test_two_levels_as_pipedream_defines_them() -> None:
    # 2 GPUs per server at 1e12 B/s, 2 servers at 1e9 B/s. In a server a layer runs on
    # both GPUs in (1 + 4 * 1e9 / 2e12) / 2 = 0.501 s; across servers the whole model on
    # both servers would pay (1 + 4 * 2e9 / 2e9 / 2) / 2 = 1.5 s; one layer per server
    # costs 0.501 s (the 0.2 s transfer hides)
    profile = chain([1, 1], outputs=[10**8, 0], parameters=[10**9, 10**9])
    p = make_plan(profile, PlannerConfig(topology=Topology.from_lists([2, 2], [1e12, 1e9]),
                                         cost_model="pipedream"))
    assert p.time_per_step == pytest.approx(0.501)
    assert [(s.nodes, s.replicas_per_level, s.outer_stage) for s in p.stages] == [
        ((0,), (2, 1), (0,)), ((1,), (2, 1), (1,))]
    assert p.workers_used == 4


def test_plans_check_against_their_profile() -> None:
    profile = graph("abcd", [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], [1, 2, 3, 4])
    for workers in (1, 2, 3, 4):
        p = plan(profile, workers, straight=workers > 2)
        p.check(profile)
        assert p.workers_used == workers
