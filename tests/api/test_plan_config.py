"""Running a plan: the pipeline configuration of a plan file, and plans that do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.api.plan_config import config_from_plan
from pipetrain.plan import Plan, PlanStage


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
