"""Running a plan: the pipeline configuration of a plan file, and plans that do not fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import gpt_job, gpt_reference
from pipetrain.api.plan_config import config_from_plan
from pipetrain.plan import (
    LayerProfile,
    Plan,
    PlannerConfig,
    PlanStage,
    Profile,
    Topology,
    make_plan,
)


def _plan(*stages: tuple[tuple[object, ...], int], **fields: object) -> Plan:
    return Plan(stages=tuple(PlanStage(nodes=nodes, replicas=r) for nodes, r in stages),  # type: ignore[arg-type]
                cost_model="pipedream", time_per_step=1.0,
                num_workers=sum(r for _, r in stages), **fields)  # type: ignore[arg-type]


def test_a_plan_file_becomes_the_layout_it_describes(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    _plan(((0, 1, 2, 3), 2), ((4, 5), 1), schedule="gpipe", num_microbatches=3,
          checkpoint="always").save(path)
    config = config_from_plan(path, num_layers=6, clip_grad_norm=1.0)
    assert config.balance == [4, 2] and config.stage_replicas == (2, 1)
    assert (config.schedule, config.num_microbatches, config.checkpoint) == ("gpipe", 3, "always")
    assert config.world_size == 3 and config.clip_grad_norm == 1.0
    # the same replica count everywhere is plain data parallelism
    even = config_from_plan(_plan(((0,), 2), ((1,), 2)), num_layers=2)
    assert even.replicas == 2 and even.stage_replicas is None
    # fields given win over the plan's choices
    assert config_from_plan(path, num_layers=6, schedule="1f1b").schedule == "1f1b"


def test_a_plan_for_another_model_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"the plan cuts 6 layers .* but the model has 8 layers.*plan again"):
        config_from_plan(_plan(((0, 1, 2, 3), 2), ((4, 5), 1)), num_layers=8)
    with pytest.raises(ValueError, match=r"plan stage 0 names nodes \['node2', 'node3'\].*graph model"):
        config_from_plan(_plan((("node2", "node3"), 1), (("node4",), 1)))
    with pytest.raises(ValueError, match=r"plan stage 1 holds layers \[3, 4\], not the consecutive layers 2..3"):
        config_from_plan(_plan(((0, 1), 1), ((3, 4), 1), ((2,), 1)))


def _gpt_profile() -> Profile:
    """The test GPT's 5 layers (embedding, 3 blocks, head), as if profiled on 7 samples."""
    layers = tuple(LayerProfile(name=str(k), forward_s=f, backward_s=2 * f, parameter_bytes=4000,
                                output_bytes=800, saved_bytes=70_000)
                   for k, f in enumerate((2.0, 8.0, 8.0, 0.5, 0.5)))
    return Profile(layers=layers, batch_size=7)


def _planned(memory: float | None) -> Plan:
    return make_plan(_gpt_profile(), PlannerConfig(topology=Topology.flat(3, 1e9),
                                                   memory_limit=memory))


def test_the_pipetrain_plans_choices_become_the_configuration() -> None:
    # 80 kB: stage 1 on two workers (1-2), 1F1B, 7 micro-batches
    replicated = _planned(80_000)
    config = config_from_plan(replicated, num_layers=5)
    assert config.balance == [1, 4] and config.stage_replicas == (1, 2)
    assert (config.schedule, config.num_microbatches, config.checkpoint) == ("1f1b", 7, "never")
    # 50 kB: re-materializing, zero bubble on a straight pipeline (ZB-H2's larger budget
    # still fits, and beats ZB-H1), each stage the fastest mode that fits it (one mode per
    # stage): the first two spare their last micro-batch, the last rebuilds layer by layer
    tight = config_from_plan(_planned(50_000), num_layers=5)
    assert (tight.schedule, tight.checkpoint, tight.replicas) == (
        "zb-h2", "except_last,except_last,per_layer", 1)
    assert tight.checkpoint_modes == ("except_last", "except_last", "per_layer")
    # any plan of the planner is a configuration the pipeline accepts (the constructor
    # checks the schedule against the replica counts)
    rng = random.Random(2)
    for _ in range(30):
        layers = tuple(LayerProfile(name=str(k), forward_s=rng.uniform(0.1, 3),
                                    backward_s=rng.uniform(0.1, 6),
                                    parameter_bytes=rng.choice([0, 10**8, 10**9]),
                                    output_bytes=10**6) for k in range(rng.randint(1, 6)))
        profile = Profile(layers=layers, batch_size=rng.choice([4, 6, 8, 12]))
        workers = rng.randint(1, 4)
        plan = make_plan(profile, PlannerConfig(topology=Topology.flat(workers, 1e9),
                                                fewer_workers=True))
        config = config_from_plan(plan, num_layers=len(layers))
        assert config.world_size == plan.workers_used
        assert config.total_microbatches <= profile.batch_size


@pytest.mark.distributed
def test_the_pipetrain_plans_train_as_one_process_does() -> None:
    """The planned layouts and choices run and give single-process training's weights."""
    names = ("num_stages", "balance", "replicas", "stage_replicas", "schedule",
             "num_microbatches", "checkpoint")
    configs = []
    for memory in (80_000, 50_000):
        config = config_from_plan(_planned(memory), num_layers=5)
        configs.append({name: getattr(config, name) for name in names})
    results = run_workers(gpt_job, 3, configs, 3, timeout=300)
    reference_params, reference_losses = gpt_reference(3)
    for c, config in enumerate(configs):
        merged: dict[str, Any] = {}
        for rank_results in results:
            merged.update(rank_results[c][0])
        assert set(merged) == set(reference_params)
        worst = max(float((merged[k] - reference_params[k]).abs().max()) for k in merged)
        assert worst < 1e-5, (config, worst)
        losses = results[0][c][1]
        assert max(abs(a - b) for a, b in zip(losses, reference_losses)) < 1e-5, config


def test_a_plan_made_for_another_model_with_as_many_layers_is_refused_naming_both() -> None:
    """Bug: a plan was matched to a model by its layer count only, so a plan made from an
    MLP's profile ran a GPT once --layers made the counts agree."""
    import torch

    from pipetrain.models import GPTConfig, gpt_layer_factories, mlp_layer_factories
    from pipetrain.plan.profiler import identify_model, profile_model

    mlp = mlp_layer_factories(width=16, depth=6, seed=0)
    profile = profile_model(mlp, torch.randn(4, 16), device="cpu", warmup=0, repetitions=1)
    assert profile.model["summary"] == "6 layers (6 x Sequential(Linear, ReLU)), 1,632 parameters"
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(2, 1e9)))
    assert plan.profile["model"] == profile.model
    gpt = identify_model(gpt_layer_factories(GPTConfig(num_layers=4, width=16, num_heads=2,
                                                       context=16), seed=0), name="gpt")
    with pytest.raises(ValueError) as refused:
        config_from_plan(plan, num_layers=6, model=gpt)
    message = str(refused.value)
    assert "made from a profile of another model" in message
    assert profile.model["summary"] in message and gpt["summary"] in message
    assert "fix: profile this model and plan again" in message
    same = identify_model(mlp)
    assert same["digest"] == profile.model["digest"]
    assert config_from_plan(plan, num_layers=6, model=same).num_stages == plan.num_stages
