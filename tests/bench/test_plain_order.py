"""The zero-overhead reference of vs_torch_pipelining: plain autograd running a schedule's
order for one rank, with no pipeline."""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.bench.vs_torch.plain import PlainOrder, beside_pipelines
from pipetrain.models import mlp_layer_factories
from pipetrain.schedule import build_schedule, default_stages_per_rank

M = 4


def _schedule(name: str):
    return build_schedule(name, num_ranks=2, num_microbatches=M,
                          stages_per_rank=default_stages_per_rank(name), optimizer_step=True,
                          reduce=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_the_last_rank_trains_its_stage_as_plain_autograd_on_the_fixed_input() -> None:
    factories = mlp_layer_factories(width=8, depth=4, activation="gelu", seed=0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plain = PlainOrder(_schedule("1f1b"), factories, rank=1, loss_fn=nn.functional.mse_loss,
                       optimizer=_sgd, example=x)
    plain.step(x, y)
    plain.after_timed_step()
    # by hand: stage 1 (layers 2, 3) on stage 0's output of the first micro-batch, one loss
    # per micro-batch, the gradients summed, one SGD step
    first = nn.Sequential(factories[0](), factories[1]())
    stage = nn.Sequential(factories[2](), factories[3]())
    with torch.no_grad():
        h = first(x.chunk(M)[0])
    for target in y.chunk(M):
        nn.functional.mse_loss(stage(h), target).backward()
    _sgd(stage.parameters()).step()
    for got, want in zip(plain.modules[1].parameters(), stage.parameters()):
        torch.testing.assert_close(got, want)
    costs = plain.costs()
    assert set(costs) == {"forward", "backward", "step"}
    assert all(set(by_stage) == {1} and by_stage[1] > 0 for by_stage in costs.values())


def test_every_compute_action_of_the_rank_is_timed_once_a_split_backward_at_its_input_half() -> None:
    factories = mlp_layer_factories(width=8, depth=4, activation="gelu", seed=0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for name, stages in (("interleaved-1f1b", {0, 2}), ("zb-v", {0, 3}), ("zb-h1", {0})):
        plain = PlainOrder(_schedule(name), factories, rank=0,
                           loss_fn=nn.functional.mse_loss, optimizer=_sgd, example=x)
        plain.step(x, y)
        assert {j: len(v) for j, v in plain._now["forward"].items()} == {j: M for j in stages}
        assert {j: len(v) for j, v in plain._now["backward"].items()} == {j: M for j in stages}
        assert set(plain._now["step"]) == stages
    assert plain.costs() == {}  # no timed step recorded yet
    plain.after_timed_step()
    assert set(plain.costs()["backward"]) == stages


def test_a_plain_runner_is_timed_right_after_each_pipeline() -> None:
    class Runner:
        def __init__(self, framework: str, name: str) -> None:
            self.framework, self.schedule_name = framework, name

    runners = [Runner("pipetrain", "gpipe"), Runner("torch", "gpipe"), Runner("pipetrain", "zb-v")]
    ordered, plains = beside_pipelines(runners, lambda r: f"plain {r.schedule_name}")
    assert plains == ["plain gpipe", "plain zb-v"]
    assert ordered == [runners[0], "plain gpipe", runners[1], runners[2], "plain zb-v"]
