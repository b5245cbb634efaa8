"""torchgpipe's balancers are thin: the plan profiler's per-layer costs, then the one solver.

If a second profiler or solver grows back in pipetrain.partition, these fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain.partition
import pipetrain.plan.layer_costs
from pipetrain.partition import balance_by_size, balance_by_time
from pipetrain.plan import LayerProfile, PlannerConfig, Profile, Topology, make_plan
from pipetrain.plan.contiguous import solve
from pipetrain.plan.measure import Sample, Timings
from pipetrain.plan.memory import cuda_block_bytes
from pipetrain.plan.profiler import profile_model
from pipetrain.plan.profiler_inputs import default_device
from pipetrain.skip import current_skip_tracker, pop, skippable, stash

CPU = torch.device("cpu")
PARTITION = Path(pipetrain.partition.__file__).resolve().parent


def test_the_partition_profiles_are_the_plan_profilers():
    assert pipetrain.partition.profile_times is pipetrain.plan.layer_costs.profile_times
    assert pipetrain.partition.profile_sizes is pipetrain.plan.layer_costs.profile_sizes
    assert pipetrain.partition.default_device is default_device
    assert pipetrain.partition.solve is solve


def test_balance_by_time_cuts_the_plan_profilers_timings_with_the_one_solver(monkeypatch):
    # the profiler's in-order timings, made up: forward + backward of each layer
    forward, backward = [1.0, 1.0, 6.0, 1.0, 1.0], [0.5, 0.5, 2.0, 0.5, 0.5]
    built: list[nn.Module] = []

    def timings(layers, sample, *, device, timeout):
        built.extend(build() for build in layers)
        return [Timings(forward=[Sample(f)], backward=[Sample(b)])
                for f, b in zip(forward, backward)]

    monkeypatch.setattr(pipetrain.plan.layer_costs, "time_in_order", timings)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    costs = [f + b for f, b in zip(forward, backward)]
    balance = balance_by_time(3, model, torch.randn(2, 4), timeout=0.0, device="cpu")
    assert balance == solve(costs, 3) == [2, 1, 2]
    # copies of the model's own layers, in order, were timed
    assert [type(layer) for layer in built] == [type(layer) for layer in model]
    assert all(copy is not layer for copy, layer in zip(built, model))
    # and the planner cuts a straight pipeline over the same costs the same way
    profile = Profile(layers=tuple(LayerProfile(name=str(j), forward_s=f, backward_s=b)
                                   for j, (f, b) in enumerate(zip(forward, backward))))
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(3, 1e9),
                                            cost_model="pipedream", straight=True))
    assert [len(stage.nodes) for stage in plan.stages] == balance


@pytest.mark.parametrize(("chunks", "param_scale"), [(1, 2.0), (4, 3.0)])
def test_balance_by_size_weighs_with_the_plan_profiler(chunks, param_scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1024), nn.ReLU(),
                          nn.Linear(1024, 16), nn.Tanh())
    x = torch.randn(32, 16)
    sizes = pipetrain.plan.layer_costs.profile_sizes(model, x, chunks=chunks,
                                                     param_scale=param_scale, device=CPU)
    for partitions in (2, 3, 4):
        assert balance_by_size(partitions, model, x, chunks=chunks, param_scale=param_scale,
                               device="cpu") == solve(sizes, partitions)
    # the parameters weigh what the profiler's profile says they hold
    profile = profile_model(model, x, device="cpu", warmup=0, repetitions=1)
    rows = 32 / chunks
    latent = [size - layer.parameter_bytes * param_scale
              for size, layer in zip(sizes, profile.layers)]
    # what remains is one sample's new storages in 512-byte blocks, per micro-batch
    assert all(value > 0 and value / rows == cuda_block_bytes(int(value / rows))
               for value in latent)


@skippable(stash=["skip"])
class Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor):
        y = self.linear(x)
        yield stash("skip", y)
        return torch.relu(y)


@skippable(pop=["skip"])
class Pop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 512)  # large enough for the fused backward's walk

    def forward(self, x: torch.Tensor):
        skip = yield pop("skip")
        return self.linear(x) + skip


def test_layers_with_skip_connections_are_timed_in_order():
    model = nn.Sequential(Stash(), nn.Linear(512, 512), Pop())
    times = pipetrain.partition.profile_times(model, torch.randn(4, 512), timeout=0.05,
                                              device=CPU)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert len(current_skip_tracker()) == 0  # every stash was popped, pass after pass
    assert all(p.grad is None for p in model.parameters())


def test_the_partition_package_measures_nothing_itself():
    measuring = re.compile(r"perf_counter|process_time|saved_tensors_hooks|autograd\.|"
                           r"memory_allocated|\.backward\(|untyped_storage")
    found = {path.name: sorted(set(measuring.findall(path.read_text())))
             for path in PARTITION.glob("*.py")}
    assert {name: hits for name, hits in found.items() if hits} == {}
