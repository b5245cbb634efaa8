"""``pipetrain train --balance auto`` profiles, plans and trains; ``--plan FILE`` runs a
plan of ``pipetrain plan`` (replicas per stage included); plans that do not fit are
refused before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.train_runs import refused_here
from pipetrain.plan import Plan, PlanStage

pytestmark = pytest.mark.distributed

TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "8",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "0", "--sample-bytes", "0",
        "--steps", "3"]


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "pipetrain", "train", *TINY, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_auto_balance_and_a_plan_with_replicas_train_the_same_losses(tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    done = _train("--stages", "2", "--balance", "auto", "--out", str(auto))
    assert done.returncode == 0, done.stderr[-3000:]
    plan = Plan.load(auto / "plan.json")
    assert plan.num_stages == 2 and (auto / "profile.json").is_file()
    assert sum(len(s.nodes) for s in plan.stages) == 4  # embedding, 2 blocks, head
    # the pipetrain cost model chose the schedule and the checkpoint mode, which the run
    # took; the micro-batches were given (--microbatches 2), so the plan kept them
    assert plan.cost_model == "pipetrain" and plan.num_microbatches == 2
    ran = json.loads((auto / "config.json").read_text())["args"]
    assert (ran["schedule"], ran["checkpoint"], ran["microbatches"]) == (
        plan.schedule, plan.checkpoint, 2)

    # a 2-1 plan: the first stage on two workers
    layout = Plan(stages=(PlanStage(nodes=(0, 1, 2), replicas=2), PlanStage(nodes=(3,), replicas=1)),
                  cost_model="pipedream", time_per_step=1.0, num_workers=3)
    layout.save(tmp_path / "plan.json")
    replicated = tmp_path / "replicated"
    done = _train("--plan", str(tmp_path / "plan.json"), "--out", str(replicated))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _metrics(replicated)["config"]["world_size"] == 3
    for a, b in zip(_metrics(auto)["steps"], _metrics(replicated)["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)


def test_plans_that_do_not_fit_the_run_are_refused(tmp_path: Path) -> None:
    other = Plan(stages=(PlanStage(nodes=(0, 1, 2, 3, 4), replicas=1), PlanStage(nodes=(5,), replicas=1)),
                 cost_model="pipedream", time_per_step=1.0, num_workers=2)
    other.save(tmp_path / "other.json")
    done = refused_here(["train", *TINY, "--plan", str(tmp_path / "other.json"), "--stages", "2"])
    assert done.returncode == 2
    assert "--plan sets the stages and replicas; fix: leave out --stages" in done.stderr
    assert "cuts 6 layers" in done.stderr and "the model has 4 layers" in done.stderr
    done = refused_here(["train", *TINY, "--balance", "1,1"])
    assert done.returncode == 2 and "--balance 1,1 gives 2 stages of 2 layers" in done.stderr


def test_a_plan_that_chose_fsdp_trains_with_fsdp_unless_told_otherwise(tmp_path: Path) -> None:
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.train_checks import prepare

    plan = Plan(stages=(PlanStage(nodes=(0, 1), replicas=2), PlanStage(nodes=(2, 3), replicas=2)),
                cost_model="pipetrain", time_per_step=1.0, num_workers=4, schedule="1f1b",
                num_microbatches=2, checkpoint="never", data_parallel="fsdp",
                replicated_memory=1e9)
    path = tmp_path / "plan.json"
    plan.save(path)
    small = ["train", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
             "--batch-size", "8", "--sample-bytes", "0", "--plan", str(path)]
    config, _, problems = prepare(build_parser().parse_args(small))
    assert problems == [] and config.fsdp and config.source("fsdp") == "plan"
    assert (config.stages, config.replicas, config.schedule) == (2, 2, "1f1b")
    plan = Plan.from_dict({**plan.to_dict(), "data_parallel": "replicate"})
    plan.save(path)
    config, _, problems = prepare(build_parser().parse_args(small))
    assert problems == [] and not config.fsdp


def test_a_plan_with_fsdp_options_trains_with_them(tmp_path: Path) -> None:
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.train_checks import prepare

    plan = Plan(stages=(PlanStage(nodes=(0, 1), replicas=2), PlanStage(nodes=(2, 3), replicas=2)),
                cost_model="pipetrain", time_per_step=1.0, num_workers=4, schedule="1f1b",
                num_microbatches=2, checkpoint="never", data_parallel="fsdp",
                reduce_each_microbatch=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).reduce_each_microbatch and not Plan.load(path).reshard_after_forward
    small = ["train", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
             "--batch-size", "8", "--sample-bytes", "0", "--plan", str(path)]
    config, _, problems = prepare(build_parser().parse_args(small))
    assert problems == [] and config.fsdp and config.fsdp_reduce_each_microbatch
    assert config.source("fsdp_reduce_each_microbatch") == "plan" and not config.fsdp_reshard
