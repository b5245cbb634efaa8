"""``--balance auto`` (``cli/auto_balance.py``): what the planner is asked, and which of
the plan's choices the run takes."""

from __future__ import annotations

from pipetrain.cli.auto_balance import plan_choices, planner_config
from pipetrain.cli.run_config import RunConfig
from pipetrain.plan import Plan, PlanStage


def _args(**given: object) -> RunConfig:
    config = RunConfig()
    config.set("command line", **given)
    return config


def test_the_planner_keeps_what_the_user_gave() -> None:
    free = planner_config(_args(), 2)
    assert free.cost_model == "pipetrain" and free.straight and free.topology.num_workers == 2
    assert (free.schedules, free.num_microbatches, free.checkpoints) == (None, None, None)
    fixed = planner_config(_args(schedule="gpipe", microbatches=4), 3)
    assert (fixed.schedules, fixed.num_microbatches, fixed.checkpoints) == (("gpipe",), (4,), None)
    # an interleaved schedule runs several stages per rank, which plans do not describe
    interleaved = planner_config(_args(schedule="interleaved-1f1b", virtual=2), 4)
    assert interleaved.cost_model == "pipedream" and interleaved.schedules is None


def test_the_run_takes_the_plans_choices_unless_given() -> None:
    plan = Plan(stages=(PlanStage(nodes=(0, 1), replicas=1), PlanStage(nodes=(2,), replicas=1)),
                cost_model="pipetrain", time_per_step=1.0, num_workers=2, schedule="zb-h1",
                num_microbatches=4, checkpoint="always")
    assert plan_choices(_args(), plan) == {"schedule": "zb-h1", "microbatches": 4,
                                           "checkpoint": "always"}
    assert plan_choices(_args(microbatches=8, checkpoint="never"), plan) == {"schedule": "zb-h1"}
    chose_nothing = Plan(stages=plan.stages, cost_model="pipedream", time_per_step=1.0,
                         num_workers=2)
    assert plan_choices(_args(), chose_nothing) == {}
