"""Plan files (``pipetrain/plan/plan_file.py``) and topologies (``topology.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.plan_file import Plan, PlanStage
from pipetrain.plan.profile import Profile
from pipetrain.plan.topology import Level, Topology

from .helpers import chain, graph


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    profile = graph("abcd", [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], [1, 5, 10, 5])
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(3, 1e9), cost_model="pipedream"))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    data = json.loads(path.read_text())
    assert data["format"] == "pipetrain-plan" and data["cost_model"] == "pipedream"
    assert data["time_per_step"] == plan.time_per_step
    assert [s["nodes"] for s in data["stages"]] == [list(s.nodes) for s in plan.stages]
    assert data["profile"]["num_nodes"] == 4 and data["profile"]["digest"].startswith("sha256:")
    assert data["topology"] == {"levels": [{"num_workers": 3, "bandwidth": 1e9}]}
    assert (data["schedule"], data["num_microbatches"], data["checkpoint"]) == (None, None, None)


def test_sequences_name_layers_by_index() -> None:
    profile = chain([1, 2, 3, 4])
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(2, 1e9), cost_model="pipedream",
                                            straight=True))
    assert [s.nodes for s in plan.stages] == [(0, 1, 2), (3,)]
    assert plan.layer_indices(profile) == [[0, 1, 2], [3]]


def test_check_finds_what_does_not_partition_the_model() -> None:
    profile = graph("abc", [("a", "b"), ("b", "c")], [1, 1, 1])
    good = Plan(stages=(PlanStage(nodes=("a",), replicas=1), PlanStage(nodes=("b", "c"), replicas=1)),
                cost_model="pipedream", time_per_step=1.0, num_workers=2)
    good.check(profile)
    backwards = Plan(stages=(PlanStage(nodes=("b", "c"), replicas=1),
                             PlanStage(nodes=("a",), replicas=1)),
                     cost_model="pipedream", time_per_step=1.0, num_workers=2)
    with pytest.raises(ValueError, match="edge 'a' -> 'b' points from stage 1 back to stage 0"):
        backwards.check(profile)
    missing = Plan(stages=(PlanStage(nodes=("a", "b"), replicas=1),),
                   cost_model="pipedream", time_per_step=1.0, num_workers=1)
    with pytest.raises(ValueError, match=r"nodes \['c'\] are in no stage"):
        missing.check(profile)


def test_bad_plan_data_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"not a pipetrain plan .*pipetrain plan --out"):
        Plan.from_dict({"format": "pipetrain-profile"})
    with pytest.raises(ValueError, match=r"missing field\(s\) \['time_per_step'"):
        Plan.from_dict({"format": "pipetrain-plan", "stages": [], "cost_model": "x"})
    with pytest.raises(ValueError, match="plan stage 1: needs 'nodes' and 'replicas'"):
        Plan.from_dict({"format": "pipetrain-plan", "cost_model": "x", "time_per_step": 1.0,
                        "num_workers": 2, "stages": [{"nodes": [0], "replicas": 1}, {}]})
    with pytest.raises(ValueError, match=r"replicas=0 must be a whole number >= 1"):
        PlanStage(nodes=(0,), replicas=0)
    with pytest.raises(ValueError, match=r"multiply to 6, not replicas=4"):
        PlanStage(nodes=(0,), replicas=4, replicas_per_level=(2, 3))
    with pytest.raises(ValueError, match="use 3 workers but num_workers is 2"):
        Plan(stages=(PlanStage(nodes=(0,), replicas=3),), cost_model="x", time_per_step=1.0,
             num_workers=2)


def test_bad_profile_times_name_the_layer_and_field() -> None:
    def layer(**fields: object) -> dict[str, object]:
        return {"format": "pipetrain-profile",
                "layers": [{"name": "0", "forward_s": 1.0, "backward_s": 1.0, **fields}]}

    with pytest.raises(ValueError, match=r"layer 0 \('0'\): optimizer_step_s=-1 must be a number"):
        Profile.from_dict(layer(optimizer_step_s=-1))
    with pytest.raises(ValueError, match=r"microbatch_forward_s='fast' must be a number"):
        Profile.from_dict(layer(microbatch_forward_s="fast"))
    assert Profile.from_dict(layer(optimizer_step_s=0.5)).layers[0].optimizer_step_s == 0.5


def test_topology_levels_innermost_first() -> None:
    t = Topology.from_lists([8, 4], [300e9, 25e9])
    assert t.num_workers == 32 and t.levels[0] == Level(num_workers=8, bandwidth=300e9)
    assert Topology.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError) as error:
        Topology.from_lists([8, 4], [300e9], spell=("--workers", "--bandwidth"))
    assert "--workers has 2 value(s) [8, 4] but --bandwidth has 1" in str(error.value)
    assert "one bandwidth per level, innermost first" in str(error.value)
    with pytest.raises(ValueError, match=r"level 1: num_workers=0 .*level 1: bandwidth=-1.0"):
        Topology.from_lists([2, 0], [1e9, -1.0])
