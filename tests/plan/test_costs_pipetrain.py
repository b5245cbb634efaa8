"""The ``pipetrain`` cost model (``plan/costs_pipetrain.py``), the micro-batch profile and
the simulated step, on hand-computed cases."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pipetrain.plan.costs import LevelContext, StageLoad, StageRow, scan_min_replicas
from pipetrain.plan.costs_pipetrain import (
    UNRUNNABLE_BYTES,
    UNRUNNABLE_TIME,
    Candidate,
    PipetrainCostModel,
    ReplicaGroups,
)
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.microbatch_profile import microbatch_counts, microbatch_profile
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.simulated_step import (
    link_time,
    predicted_step,
    simulate_step,
    step_costs,
    step_lower_bound,
)
from pipetrain.schedule import Costs, build_schedule, simulate

LEVEL = LevelContext(bandwidth=1e9)


def _load(**fields: float | bool) -> StageLoad:
    base: dict[str, float | bool] = {
        "compute_s": 3.0, "forward_s": 1.0, "parameter_bytes": 10.0, "activation_bytes": 0.0,
        "input_bytes": 4.0, "output_bytes": 0.0, "is_first": False, "is_last": True,
        "weight_memory_bytes": 100.0, "saved_bytes": 20.0,
    }
    return StageLoad(**(base | fields))  # type: ignore[arg-type]


def _memory(schedule: str, checkpoint: str, *, n: int = 4, workers_from_stage: int = 2,
            num_workers: int = 3) -> float:
    model = PipetrainCostModel(Candidate(schedule=schedule, num_microbatches=n,
                                         checkpoint=checkpoint), num_workers=num_workers)
    return model.stage_memory(_load(), replicas=1, workers_from_stage=workers_from_stage)


def test_memory_per_worker_by_schedule_and_checkpoint_mode() -> None:
    # weights 100 (parameters 10); a micro-batch keeps its input 4 and saved 20 (24 whole)
    assert _memory("gpipe", "never") == 100 + 4 * 24  # all 4 micro-batches
    assert _memory("gpipe", "always") == 100 + 4 * 4 + 20  # inputs, one recomputed
    assert _memory("gpipe", "except_last") == 100 + 24 + 3 * 4  # the last first, then freed
    assert _memory("1f1b", "never") == 100 + 2 * 24  # min(K - j, M): 2 workers from here
    assert _memory("1f1b", "always") == 100 + 2 * 4 + 20
    assert _memory("1f1b", "except_last") == 100 + 24 + 4 + 20  # last kept, one recomputed
    assert _memory("1f1b", "never", n=1) == 100 + 24  # fewer micro-batches than in flight
    assert _memory("zb-h1", "never") == 100 + 3 * 24  # min(K, M) from F to W, K = 3 workers
    assert _memory("pipedream", "never") == 100 + 2 * 24 + 1 * 10  # one stashed version
    assert _memory("pipedream", "never", workers_from_stage=4) == 100 + 4 * 24 + 3 * 10
    assert _memory("2bw", "never", workers_from_stage=4) == 100 + 4 * 24 + 10  # two versions
    # more workers downstream never means less memory (the planner's contract)
    for schedule in ("gpipe", "1f1b", "zb-h1", "pipedream", "2bw"):
        values = [_memory(schedule, "never", workers_from_stage=w) for w in range(1, 8)]
        assert values == sorted(values)


def test_stage_time_per_step() -> None:
    load = _load(gradient_bytes=1e9, optimizer_step_s=0.5, input_bytes=1e8, output_bytes=2e8,
                 is_last=False)
    model = PipetrainCostModel(Candidate(num_microbatches=6, checkpoint="except_last"))
    # 2 replicas: 3 micro-batches each of F + B = 3, two of them recomputed (F = 1), the
    # step, and the ring all-reduce of 1 GB: 2 (2 - 1) / 2 * 1 s
    assert model.stage_time(load, replicas=2, level=LEVEL) == pytest.approx(9 + 2 + 0.5 + 1)
    # a slow link bounds it instead: 3 micro-batches x 4 GB each way at 1 GB/s
    linked = _load(optimizer_step_s=0.5, input_bytes=2e9, output_bytes=2e9, is_last=False)
    assert model.stage_time(linked, replicas=2, level=LEVEL) == pytest.approx(12.0)
    # unrunnable: more replicas than micro-batches; a first stage not dividing them
    assert model.stage_time(load, replicas=7, level=LEVEL) == UNRUNNABLE_TIME
    first = _load(is_first=True)
    assert model.stage_time(first, replicas=4, level=LEVEL) == UNRUNNABLE_TIME
    assert model.stage_memory(first, replicas=4, workers_from_stage=4) == UNRUNNABLE_BYTES
    assert model.stage_time(first, replicas=3, level=LEVEL) < UNRUNNABLE_TIME
    # groups of replicas: 1 group of 3 is 3 replicas
    grouped = ReplicaGroups(model, 3)
    assert grouped.stage_time(load, replicas=1, level=LEVEL) == model.stage_time(
        load, replicas=3, level=LEVEL)


def test_min_replicas_equals_the_scan_on_random_stages() -> None:
    rng = random.Random(5)
    for _ in range(200):
        loads = [_load(compute_s=rng.uniform(0.1, 5), forward_s=0.05,
                       gradient_bytes=rng.choice([0.0, 1e8, 1e9, 5e9]),
                       optimizer_step_s=rng.uniform(0, 1), is_first=first, is_last=False,
                       output_bytes=rng.choice([0.0, 1e9]))
                 for first in [rng.random() < 0.5] for _ in range(4)]
        row = StageRow.of(loads)
        model = PipetrainCostModel(Candidate(num_microbatches=rng.randint(1, 12),
                                             checkpoint=rng.choice(["never", "always"])))
        limit, at_least = rng.uniform(0.5, 20), rng.randint(1, 3)
        options = {"level": LEVEL, "time_limit": limit, "max_replicas": 9, "at_least": at_least}
        assert model.min_replicas(row, **options) == scan_min_replicas(model, row, **options)


def test_microbatch_profile_scales_times_on_the_measured_line() -> None:
    layer = LayerProfile(name="0", forward_s=0.9, backward_s=1.8, backward_input_s=1.0,
                         backward_weight_s=0.8, output_bytes=900, saved_bytes=90,
                         parameter_bytes=7, optimizer_step_s=0.25,
                         microbatch_forward_s=0.2, microbatch_backward_s=0.3)
    profile = Profile(layers=(layer,), batch_size=9, microbatch_size=2)
    three = microbatch_profile(profile, 3).layers[0]  # 3 samples: 2 and 9 measured
    assert three.forward_s == pytest.approx(0.2 + 0.7 * 1 / 7)
    assert three.backward_s == pytest.approx(0.3 + 1.5 * 1 / 7)
    assert three.backward_input_s == pytest.approx(1.0 / 3)  # not measured small: a share
    assert (three.output_bytes, three.saved_bytes, three.parameter_bytes) == (300, 30, 7)
    assert three.optimizer_step_s == 0.25 and three.microbatch_forward_s is None
    # below the small measurement the line may fall to 0; the share of the small one holds
    steep = LayerProfile(name="0", forward_s=9.0, backward_s=0.0, microbatch_forward_s=0.1)
    one = microbatch_profile(Profile(layers=(steep,), batch_size=9, microbatch_size=2), 9)
    assert one.layers[0].forward_s == pytest.approx(0.1 / 2)
    assert one.layers[0].backward_s == 0.0  # measured 0 at the full batch, not small: a share
    # where the line stays above that share, the line
    mild = LayerProfile(name="0", forward_s=2.0, backward_s=1.0, microbatch_forward_s=1.0)
    small = microbatch_profile(Profile(layers=(mild,), batch_size=9, microbatch_size=2), 9)
    assert small.layers[0].forward_s == pytest.approx(1.0 - 1.0 / 7)
    assert microbatch_counts(profile) == (1, 3, 9)
    with pytest.raises(ValueError, match="num_microbatches=0 must be a whole number >= 1"):
        microbatch_profile(profile, 0)


def _two_layer_profile(**extra: float) -> Profile:
    """Two layers, 2 samples: per micro-batch of 1, F = 1, B = 2 and 0.5 GB out."""
    layers = tuple(LayerProfile(name=str(k), forward_s=2.0, backward_s=4.0, output_bytes=10**9,
                                optimizer_step_s=0.25, **extra)  # type: ignore[arg-type]
                   for k in range(2))
    return Profile(layers=layers, batch_size=2)


def test_simulated_step_equals_a_hand_computed_timeline() -> None:
    graph = CutGraph(microbatch_profile(_two_layer_profile(), 2))
    loads = [graph.load(0, 1), graph.load(1, 2)]
    # messages take 0.5 GB / 1 GB/s = 0.5 s. GPipe: stage 1 runs F0 1.5-2.5, F1 2.5-3.5,
    # B0 3.5-5.5, B1 5.5-7.5; stage 0 gets B0's gradient at 6, B1's at 8: B1 ends at 10,
    # then its optimizer step, 0.25 s.
    for schedule in ("gpipe", "1f1b"):
        step = simulate_step(loads, [1, 1], Candidate(schedule=schedule, num_microbatches=2),
                             bandwidth=1e9)
        assert step.makespan == pytest.approx(10.25), schedule
    # checkpoint always: each backward recomputes its forward first (B = 3): stage 1 runs
    # B0 3.5-6.5, B1 6.5-9.5; stage 0 B0 7-10, B1 10-13, then its step
    step = simulate_step(loads, [1, 1], Candidate(schedule="gpipe", num_microbatches=2,
                                                  checkpoint="always"), bandwidth=1e9)
    assert step.makespan == pytest.approx(13.25)


def test_simulated_zero_bubble_step_uses_the_split_backward() -> None:
    profile = _two_layer_profile(backward_input_s=2.4, backward_weight_s=1.2)
    graph = CutGraph(microbatch_profile(profile, 2))
    loads = [graph.load(0, 1), graph.load(1, 2)]
    candidate = Candidate(schedule="zb-h1", num_microbatches=2)
    # the costs written by hand: I = 1.2, W = 0.6 per micro-batch, B = 2 as one pass
    by_hand = Costs(forward=1.0, backward=2.0, backward_input=1.2, backward_weight=0.6,
                    communication=0.5, step=0.25)
    costs = step_costs(loads, [1, 1], candidate, bandwidth=1e9).per_stage(2)
    assert costs == by_hand.per_stage(2)
    schedule = build_schedule("zb-h1", num_ranks=2, num_microbatches=2, optimizer_step=True,
                              reduce=True)
    expected = simulate(schedule, by_hand).makespan
    assert simulate_step(loads, [1, 1], candidate, bandwidth=1e9).makespan == expected
    # replicated: a stage's all-reduce, 2 (r - 1) / r * gradient bytes / bandwidth
    grads = step_costs([graph.load(0, 2)], [2], Candidate(num_microbatches=2), bandwidth=1e9)
    assert grads.reduce == (0.0,)
    heavy = _two_layer_profile(parameter_bytes=3 * 10**9)
    g = CutGraph(microbatch_profile(heavy, 2))
    assert step_costs([g.load(0, 2)], [2], Candidate(num_microbatches=2),
                      bandwidth=1e9).reduce == (6.0,)


def test_a_step_is_at_least_its_links_time_and_its_busiest_rank() -> None:
    graph = CutGraph(microbatch_profile(_two_layer_profile(), 2))
    loads = [graph.load(0, 1), graph.load(1, 2)]
    candidate = Candidate(schedule="1f1b", num_microbatches=2)
    # each stage sends or receives 0.5 GB per micro-batch: 1 s per step at 1 GB/s, 10 s
    # at 0.1 GB/s, where the link is slower than the simulated 1F1B step
    assert link_time(loads, [1, 1], candidate, bandwidth=1e9) == pytest.approx(1.0)
    slow = simulate_step(loads, [1, 1], candidate, bandwidth=1e8).makespan
    assert predicted_step(loads, [1, 1], candidate, bandwidth=1e8) == pytest.approx(
        max(slow, 10.0))
    # the lower bound: the busiest rank's 2 x (1 + 2) s and its 0.25 s step
    assert step_lower_bound(loads, [1, 1], candidate, bandwidth=1e9) == pytest.approx(6.25)


def test_every_optimizer_step_waits_for_every_stages_gradients() -> None:
    # GPipe, 2 micro-batches: stage 1's last backward ends at 7.5 and stage 0's at 10 (see
    # the hand-computed timeline above). A 3 s step on stage 1 would end at 10.5 on its
    # own, but the runtime's global gradient-norm check holds it until stage 0 is done.
    layers = tuple(LayerProfile(name=str(k), forward_s=2.0, backward_s=4.0, output_bytes=10**9,
                                optimizer_step_s=step) for k, step in enumerate((0.25, 3.0)))
    graph = CutGraph(microbatch_profile(Profile(layers=layers, batch_size=2), 2))
    loads = [graph.load(0, 1), graph.load(1, 2)]
    candidate = Candidate(schedule="gpipe", num_microbatches=2)
    assert simulate_step(loads, [1, 1], candidate, bandwidth=1e9).makespan == pytest.approx(10.5)
    assert predicted_step(loads, [1, 1], candidate, bandwidth=1e9) == pytest.approx(13.0)


def test_an_fsdp_plan_simulates_its_gathers_and_reduce_scatters() -> None:
    # 2 stages of 2 replicas, 1 GB of parameters and of gradients each, 1 GB/s
    loads = [_load(is_first=j == 0, is_last=j == 1, input_bytes=0.0, parameter_bytes=1e9,
                   gradient_bytes=1e9) for j in range(2)]
    fsdp = Candidate(schedule="1f1b", num_microbatches=4, data_parallel="fsdp")
    replicated = Candidate(schedule="1f1b", num_microbatches=4)
    sharded = step_costs(loads, [2, 2], fsdp, bandwidth=1e9)
    assert sharded.unshard == (0.5, 0.5) and sharded.reduce == (0.5, 0.5)  # (r - 1) / r * bytes
    whole = step_costs(loads, [2, 2], replicated, bandwidth=1e9)
    assert whole.unshard == (0.0, 0.0) and whole.reduce == (1.0, 1.0)  # ring all-reduce
    # the gathers are the schedule's actions: stage 0's first forward waits for its own
    step = simulate_step(loads, [2, 2], fsdp, bandwidth=1e9)
    timed = {(t.rank, str(t.action)): t for t in step.timeline}
    assert timed[(0, "0UNSHARD")].end == 0.5 == timed[(0, "0F0")].start
    assert timed[(0, "0RESHARD")].start >= timed[(0, "0REDUCE")].end
    plain = simulate_step(loads, [2, 2], replicated, bandwidth=1e9)
    assert not any(t.action.op.value == "UNSHARD" for t in plain.timeline)
    # one worker per stage: nothing to shard, whatever the candidate says
    assert simulate_step(loads, [1, 1], fsdp, bandwidth=1e9).makespan == pytest.approx(
        simulate_step(loads, [1, 1], replicated, bandwidth=1e9).makespan)


def test_fsdp_policies_price_a_gather_per_pass_and_a_reduce_scatter_per_backward() -> None:
    loads = [_load(is_first=j == 0, is_last=j == 1, input_bytes=0.0, parameter_bytes=1e9,
                   gradient_bytes=1e9) for j in range(2)]
    gathered = Candidate(schedule="1f1b", num_microbatches=4, data_parallel="fsdp")
    lean = dataclasses.replace(gathered, reshard_after_forward=True, reduce_each_microbatch=True)
    base = step_costs(loads, [2, 2], gathered, bandwidth=1e9)
    costs = step_costs(loads, [2, 2], lean, bandwidth=1e9)
    assert costs.unshard == (0.0, 0.0) and costs.reduce == (0.0, 0.0)
    assert costs.forward == tuple(f + 0.5 for f in base.forward)  # type: ignore[union-attr]
    assert costs.backward == tuple(b + 1.0 for b in base.backward)  # type: ignore[union-attr]
    # FSDP's hooks gather in line: no UNSHARD / RESHARD actions, as the runtime runs it
    step = simulate_step(loads, [2, 2], lean, bandwidth=1e9)
    assert not any(t.action.op.value in ("UNSHARD", "RESHARD") for t in step.timeline)
    assert step.makespan > simulate_step(loads, [2, 2], gathered, bandwidth=1e9).makespan
    # the stage model: 2 micro-batches a replica, 2 (gathers) per pass and 1 per backward
    model = {c.fsdp_policy: PipetrainCostModel(c) for c in (gathered, lean)}
    level = LevelContext(bandwidth=1e9)
    extra = model["lean"].stage_time(loads[0], replicas=2, level=level) - model[
        "gathered"].stage_time(loads[0], replicas=2, level=level)
    assert extra == pytest.approx(0.5 * (2 * 2 - 1) + 0.5 * (2 - 1))
    weights = dataclasses.replace(loads[0], weight_memory_bytes=4e9)
    held = {name: PipetrainCostModel(c).stage_memory(weights, replicas=2, workers_from_stage=4)
            for name, c in (("gathered", gathered), ("lean", lean))}
    assert held["gathered"] - held["lean"] == pytest.approx(2e9)  # no whole parameters, gradients
    with pytest.raises(ValueError, match="are FSDP options"):
        Candidate(num_microbatches=2, reduce_each_microbatch=True)
