"""The ``pipetrain`` cost model's planner (``plan/schedule_choice.py``, ``candidates.py``,
``depths.py``): against brute force on small models, and its choices under memory limits."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterator

import pytest

from pipetrain.plan.costs import LevelContext
from pipetrain.plan.costs_pipetrain import (
    CHECKPOINT_MODES,
    FSDP_POLICIES,
    Candidate,
    PipetrainCostModel,
)
from pipetrain.plan.depths import best_per_depth
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.microbatch_profile import microbatch_counts, microbatch_profile
from pipetrain.plan.optimizer import make_plan
from pipetrain.plan.per_stage import stage_models
from pipetrain.plan.plan_file import Plan
from pipetrain.plan.planner_config import PLANNED_SCHEDULES, PlannerConfig
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.schedule_choice import plan_for_layout, plan_pipetrain, prefer
from pipetrain.plan.search import FlatSearch
from pipetrain.plan.simulated_step import predicted_step
from pipetrain.plan.topology import Topology
from pipetrain.schedule.replicated import REPLICATED_SCHEDULES

Layout = list[tuple[int, int, int]]


def _layouts(num_layers: int, workers: int, straight: bool = False) -> Iterator[Layout]:
    """Every plan of a layer sequence on exactly ``workers`` workers (one each: straight)."""
    for k in range(workers if straight else 1, min(num_layers, workers) + 1):
        for cuts in itertools.combinations(range(1, num_layers), k - 1):
            bounds = [0, *cuts, num_layers]
            for replicas in itertools.product(range(1, workers + 1), repeat=k):
                if sum(replicas) == workers:
                    yield list(zip(bounds, bounds[1:], replicas))


def _brute_force(profile: Profile, workers: int, bandwidth: float, *,
                 checkpoints: tuple[str, ...] = ("never",), memory: float | None = None,
                 counts: tuple[int, ...] | None = None, straight: bool = False,
                 schedules: tuple[str, ...] = PLANNED_SCHEDULES) -> tuple[float, float] | None:
    """The best (simulated step, peak memory) over every plan and every candidate the
    runtime can run, by enumeration."""
    best = None
    for n in counts or microbatch_counts(profile):
        graph = CutGraph(microbatch_profile(profile, n))
        for layout, schedule, checkpoint in itertools.product(
                _layouts(profile.num_layers, workers, straight), schedules, checkpoints):
            replicas = [r for _, _, r in layout]
            if len(set(replicas)) > 1 and schedule not in REPLICATED_SCHEDULES:
                continue
            # per-stage: every assignment of a mode to each stage
            assignments = (itertools.product(CHECKPOINT_MODES, repeat=len(layout))
                           if checkpoint == "per-stage" else [None])
            for modes in assignments:
                candidate = Candidate(schedule=schedule, num_microbatches=n, checkpoint=checkpoint,
                                      stage_checkpoints=modes)
                found = _scored(graph, layout, candidate, workers, memory, bandwidth)
                if found is not None and (best is None or prefer(found, best)):
                    best = found
    return best


def _scored(graph: CutGraph, layout: list[tuple[int, int, int]], candidate: Candidate,
            workers: int, memory: float | None, bandwidth: float) -> tuple[float, float] | None:
    """(simulated step, peak memory) of one plan, None when it cannot run or fit."""
    replicas = [r for _, _, r in layout]
    loads = [graph.load(a, b) for a, b, _ in layout]
    models = stage_models(candidate, len(layout), num_workers=workers)
    if not all(model.runs(load, r) for model, load, r in zip(models, loads, replicas)):
        return None
    after, peak = workers, 0.0
    for model, load, r in zip(models, loads, replicas):
        peak = max(peak, model.stage_memory(load, replicas=r, workers_from_stage=after))
        after -= r
    if memory is not None and peak > memory:
        return None
    return predicted_step(loads, replicas, candidate, bandwidth=bandwidth), peak


def _random_profile(rng: random.Random, num_layers: int) -> Profile:
    layers = tuple(
        LayerProfile(name=str(k), forward_s=rng.uniform(0.1, 2), backward_s=rng.uniform(0.2, 4),
                     parameter_bytes=rng.choice([0, 10**6, 10**8, 10**9]),
                     output_bytes=rng.choice([10**3, 10**7, 10**8]),
                     saved_bytes=rng.choice([10**6, 10**8]),
                     optimizer_step_s=rng.uniform(0, 0.5))
        for k in range(num_layers))
    return Profile(layers=layers, batch_size=rng.choice([1, 2, 4, 6, 8]))


def _peak(plan: Plan) -> float:
    return max(s.memory_per_worker or 0.0 for s in plan.stages)


def test_the_plan_is_the_fastest_simulated_step_of_all_plans() -> None:
    """Small models: every plan is simulated, so the choice is the brute-force optimum."""
    rng = random.Random(11)
    checked = 0
    while checked < 40:
        profile = _random_profile(rng, rng.randint(2, 5))
        workers, bandwidth = rng.randint(1, 4), rng.choice([1e8, 1e9, 1e10])
        memory = rng.choice([None, None, 3e9, 1e10])
        checkpoints = ("never",) if memory is None else ("never", "except_last", "always")
        best = _brute_force(profile, workers, bandwidth, checkpoints=checkpoints, memory=memory)
        config = PlannerConfig(topology=Topology.flat(workers, bandwidth), memory_limit=memory)
        if best is None:
            with pytest.raises(ValueError, match="no plan on"):
                plan_pipetrain(profile, config)
            continue
        plan = plan_pipetrain(profile, config)
        assert (plan.time_per_step, _peak(plan)) == pytest.approx(best), (profile, workers)
        checked += 1


def test_every_depth_gets_its_smallest_slowest_stage() -> None:
    """The program over (cut, workers, stages) against brute force, for the pipetrain
    model (not monotone in replicas) under memory limits."""
    rng = random.Random(3)
    for _ in range(60):
        n, workers = rng.randint(1, 5), rng.randint(1, 4)
        profile = microbatch_profile(_random_profile(rng, n), 1)
        candidate = Candidate(schedule=rng.choice(PLANNED_SCHEDULES),
                              num_microbatches=rng.randint(1, 6),
                              checkpoint=rng.choice(["never", "always"]))
        model = PipetrainCostModel(candidate, num_workers=workers)
        memory = rng.choice([None, 5e8, 3e9])
        search = FlatSearch(CutGraph(profile), model=model, level=LevelContext(bandwidth=1e9),
                            num_workers=workers, memory_limit=memory)
        expected: dict[int, float] = {}
        for layout in _layouts(n, workers):
            after, value = workers, 0.0
            for a, b, r in layout:
                if memory is not None and search.stage_memory(a, b, r, after) > memory:
                    value = math.inf
                value = max(value, search.stage_time(a, b, r))
                after -= r
            if value < expected.get(len(layout), math.inf):
                expected[len(layout)] = value
        found = best_per_depth(search)
        assert {k: v for k, (_, v) in found.items()} == {
            k: v for k, v in expected.items() if v < math.inf}
        for k, (stages, value) in found.items():
            assert len(stages) == k and sum(r for _, _, r in stages) == workers
            assert search.bottleneck(stages) == value


def test_larger_searches_simulate_the_best_of_every_depth() -> None:
    """Without listing every plan the choice is the best simulated step among the depths'
    best plans: never better than brute force, and a plan that runs as predicted."""
    rng = random.Random(8)
    for _ in range(25):
        profile = _random_profile(rng, rng.randint(2, 5))
        workers, bandwidth = rng.randint(1, 4), rng.choice([1e8, 1e9])
        best = _brute_force(profile, workers, bandwidth)
        config = PlannerConfig(topology=Topology.flat(workers, bandwidth))
        if best is None:
            continue
        plan = plan_pipetrain(profile, config, exhaustive=0)
        assert plan.time_per_step >= best[0] - 1e-9
        assert plan.schedule is not None and plan.num_microbatches is not None
        replicas = [s.replicas for s in plan.stages]
        n = plan.num_microbatches * replicas[0]
        graph = CutGraph(microbatch_profile(profile, n))
        bounds = [0]
        for nodes in plan.layer_indices(profile):
            bounds.append(bounds[-1] + len(nodes))
        loads = [graph.load(a, b) for a, b in itertools.pairwise(bounds)]
        step = predicted_step(loads, replicas, Candidate(schedule=plan.schedule,
                                                          num_microbatches=n), bandwidth=bandwidth)
        assert plan.time_per_step == pytest.approx(step)


def _flip_profile() -> Profile:
    """Two equal layers with weights (the zero-bubble split pays) and large activations:
    per micro-batch of 1 sample, F = 1, B = 2, saved 10 kB, 1 kB crossing the cut."""
    layers = tuple(LayerProfile(name=str(k), forward_s=4.0, backward_s=8.0, parameter_bytes=1000,
                                output_bytes=4000, saved_bytes=40_000) for k in range(2))
    return Profile(layers=layers, batch_size=4)


@pytest.mark.parametrize(("memory", "schedule", "checkpoint"), [
    (None, "zb-h1", "never"),  # ZB-H1 keeps 2 micro-batches on both stages: 24 kB (ZB-H2
    # keeps 3, 35 kB, for a step a millionth shorter: as fast, so the smaller wins)
    (23_000, "1f1b", "never"),  # 1F1B keeps 1 on the last stage: 22 kB at most
    (16_000, "zb-h2", "always"),  # only re-materializing fits; ZB-H2 then is fastest
    (14_500, "zb-h1", "always"),  # ZB-H2's third micro-batch no longer fits
])
def test_the_memory_limit_flips_schedule_and_checkpoint(memory: float | None, schedule: str,
                                                        checkpoint: str) -> None:
    profile = _flip_profile()
    config = PlannerConfig(topology=Topology.flat(2, 1e9), straight=True, num_microbatches=(4,),
                           memory_limit=memory)
    modes = ("never", "except_last", "always")
    plan = plan_pipetrain(profile, dataclasses.replace(config, checkpoints=modes))
    assert (plan.schedule, plan.checkpoint, plan.num_microbatches) == (schedule, checkpoint, 4)
    best = _brute_force(profile, 2, 1e9, checkpoints=modes, memory=memory, counts=(4,),
                        straight=True)
    assert (plan.time_per_step, _peak(plan)) == pytest.approx(best)
    assert memory is None or _peak(plan) <= memory


def _deep_profile() -> Profile:
    """Eight equal layers (F = 1, B = 2 per sample) whose saved activations dwarf their
    inputs: re-materializing saves most of a micro-batch's memory."""
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0, parameter_bytes=100,
                                output_bytes=100, saved_bytes=10_000) for k in range(8))
    return Profile(layers=layers, batch_size=8)


@pytest.mark.parametrize(("memory", "modes", "gain"), [
    (6_000, "except_last,except_last,never,never", 1.08),
    (8_000, "except_last,never,never,never", 1.12),
])
def test_per_stage_modes_recompute_only_where_memory_runs_out(memory: int, modes: str,
                                                              gain: float) -> None:
    """1F1B on 4 straight stages keeps 4, 3, 2, 1 micro-batches: under a cap that the
    first stages cannot meet without re-materializing, the plan recomputes on them only
    and beats every plan with one mode for all stages (here GPipe with ``except_last``)
    by ``gain``; it is the brute-force optimum over every cut, schedule and assignment of
    modes to stages."""
    profile = _deep_profile()
    config = PlannerConfig(topology=Topology.flat(4, 1e12), straight=True, num_microbatches=(8,),
                           memory_limit=memory, schedules=("1f1b", "gpipe"))
    plan = plan_pipetrain(profile, config)
    uniform = plan_pipetrain(profile, dataclasses.replace(config, checkpoints=CHECKPOINT_MODES))
    assert (plan.schedule, plan.checkpoint) == ("1f1b", modes)
    assert uniform.time_per_step > gain * plan.time_per_step
    assert _peak(plan) <= memory
    best = _brute_force(profile, 4, 1e12, checkpoints=(*CHECKPOINT_MODES, "per-stage"),
                        memory=memory, counts=(8,), straight=True, schedules=("1f1b", "gpipe"))
    assert (plan.time_per_step, _peak(plan)) == pytest.approx(best)


def test_no_plan_fits_names_the_smallest_limit_that_does() -> None:
    profile = _flip_profile()

    def config(memory: float) -> PlannerConfig:
        return PlannerConfig(topology=Topology.flat(2, 1e9), straight=True, memory_limit=memory,
                             num_microbatches=(4,))

    with pytest.raises(ValueError) as error:
        make_plan(profile, config(12_000))
    message = str(error.value)
    # 1F1B re-materializing every micro-batch: the last stage keeps 1 input and one
    # micro-batch's saved activations, 1 + 10 kB, and 2 kB of weights and gradients
    assert "the smallest limit that fits is 13000 bytes (give --memory 13000 or more)" in message
    # there the first stage re-materializes; the last, keeping one micro-batch, need not
    assert make_plan(profile, config(13_000)).checkpoint == "always,never"
    with pytest.raises(ValueError, match="smallest limit that fits is 13000"):
        make_plan(profile, config(12_999))


def test_a_straight_pipeline_short_of_stages_says_how_many_it_needs() -> None:
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0,
                                parameter_bytes=10**9) for k in range(6))
    profile = Profile(layers=layers, batch_size=2)
    # each layer holds 2 GB of weights and gradients: 5 GB fits two layers per stage
    config = PlannerConfig(topology=Topology.flat(2, 1e9), straight=True, memory_limit=5e9)
    with pytest.raises(ValueError, match=r"needs at least 3 stages .* only 2 workers; give "
                                         r"--workers 3"):
        make_plan(profile, config)


def test_bad_choices_are_refused_with_the_fix() -> None:
    flat = Topology.flat(2, 1e9)
    with pytest.raises(ValueError, match=r"schedule 'interleaved-1f1b' cannot be planned \(it runs several stages per worker and a plan runs one\); "
                                         r"choose from gpipe, 1f1b, zb-h1"):
        PlannerConfig(topology=flat, schedules=("interleaved-1f1b",))
    with pytest.raises(ValueError, match=r"schedule 'fast' cannot be planned"):
        PlannerConfig(topology=flat, schedules=("fast",))
    with pytest.raises(ValueError, match=r"num_microbatches=\(0,\) must be whole numbers >= 1"):
        PlannerConfig(topology=flat, num_microbatches=(0,))
    with pytest.raises(ValueError, match=r"checkpoints=\('sometimes',\) must be some of never"):
        PlannerConfig(topology=flat, checkpoints=("sometimes",))
    with pytest.raises(ValueError, match=r"schedules are choices of the pipetrain cost model, "
                                         r"not of 'pipedream'"):
        PlannerConfig(topology=flat, cost_model="pipedream", schedules=("1f1b",))
    two_levels = PlannerConfig(topology=Topology.from_lists([2, 2], [1e10, 1e9]))
    with pytest.raises(ValueError, match=r"plans one-level topologies.*--cost-model pipedream"):
        make_plan(_flip_profile(), two_levels)
    # a step of one sample cannot feed two replicas, and two layers cannot fill 3 stages
    one = Profile(layers=_flip_profile().layers, batch_size=1)
    with pytest.raises(ValueError, match=r"no plan on 3 workers runs with \[1\] micro-batches"):
        make_plan(one, PlannerConfig(topology=Topology.flat(3, 1e9)))


def test_fewer_workers_leaves_them_idle_when_faster() -> None:
    # one layer whose all-reduce (2 GB of gradients) costs more than a second replica saves
    layer = LayerProfile(name="0", forward_s=0.1, backward_s=0.2, parameter_bytes=2 * 10**9)
    profile = Profile(layers=(layer,), batch_size=2)
    every = make_plan(profile, PlannerConfig(topology=Topology.flat(2, 1e9)))
    fewer = make_plan(profile, PlannerConfig(topology=Topology.flat(2, 1e9), fewer_workers=True))
    assert every.workers_used == 2 and fewer.workers_used == 1
    assert fewer.time_per_step == pytest.approx(0.3)
    assert every.time_per_step > 0.3 + 1.0  # the ring all-reduce of 2 GB at 1 GB/s alone


def test_a_given_layout_gets_its_best_choices() -> None:
    rng = random.Random(4)
    for _ in range(10):
        profile = _random_profile(rng, 4)
        workers = rng.randint(2, 4)
        balance, replicas = [2, 2], [1, workers - 1]
        config = PlannerConfig(topology=Topology.flat(workers, 1e9))
        best = None  # every schedule and micro-batch count, by hand
        for n in microbatch_counts(profile):
            graph = CutGraph(microbatch_profile(profile, n))
            loads = [graph.load(0, 2), graph.load(2, 4)]
            for schedule in PLANNED_SCHEDULES:
                candidate = Candidate(schedule=schedule, num_microbatches=n)
                model = PipetrainCostModel(candidate, num_workers=workers)
                if (len(set(replicas)) > 1 and schedule not in REPLICATED_SCHEDULES) or not all(
                        model.runs(load, r) for load, r in zip(loads, replicas)):
                    continue
                step = predicted_step(loads, replicas, candidate, bandwidth=1e9)
                best = step if best is None else min(best, step)
        if best is None:  # too few micro-batches for the replicas
            with pytest.raises(ValueError, match="no schedule, micro-batch count"):
                plan_for_layout(profile, balance, replicas, config)
            continue
        plan = plan_for_layout(profile, balance, replicas, config)
        assert [len(s.nodes) for s in plan.stages] == balance
        assert [s.replicas for s in plan.stages] == replicas
        assert plan.time_per_step == pytest.approx(best)
    with pytest.raises(ValueError, match=r"balance \[2, 1\] with replicas \[1, 1\] is not a "
                                         r"layout of this profile's 4 layers"):
        plan_for_layout(_random_profile(rng, 4), [2, 1], [1, 1], config)


def test_under_a_memory_limit_fsdp_is_chosen_where_whole_copies_do_not_fit() -> None:
    """Two layers of 100 MB of parameters with AdamW (400 MB of weight memory each) on 8
    workers: whole copies need 400 MB per worker at best (one layer per stage); FSDP over
    4 replicas holds a quarter shard plus the gathered parameters and gradients, 300 MB.
    Without a limit (or with room for whole copies) the replicated plan is kept."""
    from pipetrain.plan.table import render_plan

    mb = 1_000_000
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0,
                                parameter_bytes=100 * mb, optimizer_bytes=200 * mb,
                                output_bytes=1000) for k in range(2))
    profile = Profile(layers=layers, batch_size=8)

    def plan(memory: float | None) -> Plan:
        return plan_pipetrain(profile, PlannerConfig(topology=Topology.flat(8, 1e12),
                                                     memory_limit=memory))

    fitted = plan(350 * mb)
    assert fitted.data_parallel == "fsdp"
    assert [s.replicas for s in fitted.stages] == [4, 4]
    assert max(s.memory_per_worker or 0 for s in fitted.stages) == pytest.approx(300 * mb, rel=0.01)
    assert fitted.replicated_memory == pytest.approx(400 * mb, rel=0.01)
    assert Plan.from_json(fitted.to_json()) == fitted
    text = render_plan(fitted)
    assert "FSDP" in text and "over the limit" in text and "4 replicas" in text
    for roomy in (None, 450 * mb):
        assert plan(roomy).data_parallel in (None, "replicate")
    with pytest.raises(ValueError, match="memory"):
        plan(250 * mb)  # not even FSDP fits


def test_fsdp_policies_let_a_plan_fit_where_gathered_fsdp_does_not() -> None:
    """The two layers above on 8 workers at 1 GB/s. Sharded over all 8 (one stage, one
    micro-batch a replica), a worker holds a 100 MB shard, plus 200 MB of gathered
    parameters unless they are freed after each pass, plus 200 MB of whole gradients
    unless each backward reduce-scatters them: only the options fit under 350 MB and
    250 MB, and the planner takes the fastest policy that fits."""
    from pipetrain.plan.table import render_plan

    mb = 1_000_000
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0,
                                parameter_bytes=100 * mb, optimizer_bytes=200 * mb,
                                output_bytes=1000) for k in range(2))
    profile = Profile(layers=layers, batch_size=8)

    def plan(memory: float, policies: tuple[str, ...] = ("gathered",)) -> Plan:
        return plan_pipetrain(profile, PlannerConfig(topology=Topology.flat(8, 1e9),
                                                     memory_limit=memory,
                                                     fsdp_policies=policies))

    with pytest.raises(ValueError, match="memory"):
        plan(250 * mb)  # the default: gathered once per step only
    every = tuple(FSDP_POLICIES)
    fitted = {limit: plan(limit * mb, every) for limit in (350, 250)}
    for limit, found in fitted.items():
        assert found.data_parallel == "fsdp"
        assert max(s.memory_per_worker or 0 for s in found.stages) <= limit * mb
    # one micro-batch a replica: reducing after each backward costs no more collectives,
    # gathering for each pass one more
    assert fitted[350].reduce_each_microbatch and not fitted[350].reshard_after_forward
    lean = fitted[250]
    assert lean.reshard_after_forward and lean.reduce_each_microbatch
    assert [s.replicas for s in lean.stages] == [8]
    assert max(s.memory_per_worker or 0 for s in lean.stages) == pytest.approx(100 * mb, rel=0.01)
    assert lean.time_per_step > fitted[350].time_per_step  # a gather more per pass
    assert Plan.from_json(lean.to_json()) == lean
    assert "--fsdp --fsdp-reshard --fsdp-reduce-each-microbatch" in render_plan(lean)
    assert "(pipetrain train --fsdp --fsdp-reduce-each-microbatch)" in render_plan(fitted[350])
    with pytest.raises(ValueError, match=r"fsdp_policies=\(.fast.,\) must be some of gathered"):
        PlannerConfig(topology=Topology.flat(8, 1e9), fsdp_policies=("fast",))


def test_a_straight_plan_never_shards_a_stage_over_workers() -> None:
    """``straight``: one worker per stage, also under a memory limit, where one stage on
    both workers (here replicated; sharded with FSDP it fits too) would be faster: 6.0
    against 6.5."""
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0, parameter_bytes=1000,
                                output_bytes=10, saved_bytes=100) for k in range(4))
    profile = Profile(layers=layers, batch_size=4)
    config = PlannerConfig(topology=Topology.flat(2, 1e12), memory_limit=14_000)
    free = make_plan(profile, config)
    assert [s.replicas for s in free.stages] == [2] and free.time_per_step == pytest.approx(6.0)
    straight = make_plan(profile, dataclasses.replace(config, straight=True))
    assert [s.replicas for s in straight.stages] == [1, 1]
    assert straight.data_parallel == "replicate" and straight.time_per_step == pytest.approx(6.5)


def test_per_stage_takes_per_layer_where_only_it_fits() -> None:
    """Re-materializing layer by layer keeps each layer's (small) input and rebuilds one
    layer's saved activations at a time: under a cap between its peak and ``always``'s,
    the default search (``per-stage``) resolves stages to ``per_layer``, and no plan with
    the three stage-wide modes fits."""
    profile = _deep_profile()
    config = PlannerConfig(topology=Topology.flat(2, 1e12), straight=True, num_microbatches=(4,),
                           schedules=("1f1b",))

    def peak(modes: tuple[str, ...]) -> float:
        return _peak(plan_pipetrain(profile, dataclasses.replace(config, memory_limit=1e12,
                                                                 checkpoints=modes)))

    layered, always = peak(("per_layer",)), peak(("always",))
    assert layered < 0.5 * always
    capped = dataclasses.replace(config, memory_limit=(layered + always) / 2)
    plan = plan_pipetrain(profile, capped)
    assert "per_layer" in plan.checkpoint.split(","), plan.checkpoint
    assert _peak(plan) <= capped.memory_limit
    with pytest.raises(ValueError, match="needs at least 4 stages"):  # 2 workers: none fits
        make_plan(profile, dataclasses.replace(capped, checkpoints=("never", "except_last",
                                                                     "always")))
