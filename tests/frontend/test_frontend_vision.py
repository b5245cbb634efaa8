"""Ordinary models with skip connections that cross stages, in GPipe and in Pipeline.

A small U-Net (every encoder level skips to its decoder level: with 4 partitions the
first level's features ride through the middle partitions) and a ResNet-style network
(cut inside a residual block, so the block's input crosses the cut), split by split
points and by the planner, give the outputs, gradients and weights of the unpipelined
model. A model whose inputs and outputs are nested, with integer tensors, a boolean
mask and a tensor that needs no gradient crossing cuts, does too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers.distributed import run_workers
from helpers.vision_jobs import SPLITS, vision_batches, vision_job, vision_model, vision_reference
from pipetrain import GPipe

TOLERANCE = 1e-5


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["unet", "resnet"])
@pytest.mark.parametrize("split", [True, False])
def test_gpipe_of_a_model_with_crossing_skips_is_transparent(kind: str, split: bool) -> None:
    reference = vision_model(kind)
    model = copy.deepcopy(reference)
    x, y = vision_batches(kind, 1)[0]
    split_points = SPLITS[kind][4] if split else None
    pipe = GPipe(model, example_inputs=(x,), split_points=split_points, chunks=3,
                 checkpoint="except_last", devices=None if split else ["cpu"] * 3)
    assert len(pipe.partitions) == (4 if split else 3)
    output = pipe(x)
    expected = reference(x)
    assert float((output - expected).detach().abs().max()) < TOLERANCE
    F.mse_loss(output, y).backward()
    F.mse_loss(expected, y).backward()
    got, want = _grads(model), _grads(reference)
    assert set(got) == set(want)
    assert max(float((got[n] - want[n]).abs().max()) for n in want) < TOLERANCE


class Mixed(nn.Module):
    """Nested inputs and outputs; an int64 tensor, a bool mask and a no-grad tensor made
    in the first block are used by the last."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, ids: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, object]:
        mask = ids > 4                                   # bool
        shifted = (ids + 1) % 10                         # int64
        scale = extra["scale"].detach() * 2              # needs no gradient
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        h = h * mask.unsqueeze(-1) * scale + self.embed(shifted).sum(-1, keepdim=True)
        return {"logits": self.out(h), "parts": (mask, h.sum(-1))}


def test_nested_values_integer_tensors_and_masks_cross_cuts() -> None:
    reference = Mixed()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 10, (4, 5))
    extra = {"scale": torch.rand(4, 5, 1)}
    pipe = GPipe(model, example_inputs=(ids, extra), split_points=["blocks.1", "blocks.2", "out"],
                 chunks=2)
    output = pipe({"ids": ids, "extra": extra})
    expected = reference(ids, extra)
    assert isinstance(output, dict) and isinstance(output["parts"], tuple)
    assert torch.equal(output["parts"][0], expected["parts"][0])  # the bool mask
    assert float((output["logits"] - expected["logits"]).detach().abs().max()) < TOLERANCE
    output["logits"].sum().backward()
    expected["logits"].sum().backward()
    got, want = _grads(model), _grads(reference)
    assert max(float((got[n] - want[n]).abs().max()) for n in want) < TOLERANCE


@pytest.mark.distributed
def test_pipeline_of_models_with_crossing_skips_matches_single_process() -> None:
    configs = [{"kind": kind, "split": split, "schedule": schedule, "num_stages": 2,
                "num_microbatches": 3}
               for kind in ("unet", "resnet") for split, schedule in ((True, "1f1b"), (False, "zb-h1"))]
    results = run_workers(vision_job, 2, configs, 3, timeout=600)
    failures = []
    for c, config in enumerate(configs):
        ref_state, ref_losses = vision_reference(config["kind"], 3)
        merged = {**results[0][c][0], **results[1][c][0]}
        assert set(merged) == set(ref_state)
        worst = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
        loss_error = max(abs(a - b) for a, b in zip(results[0][c][1], ref_losses))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: |param diff| {worst:.2e}, |loss diff| {loss_error:.2e}")
    assert not failures, "\n".join(failures)


def test_a_plan_file_cuts_a_captured_model(tmp_path: object) -> None:
    """The frontend's units are the planner's layers: profile them, plan, save the plan,
    and run it (config_from_plan's balance counts units)."""
    import os

    from pipetrain import config_from_plan
    from pipetrain.frontend import CapturedModel
    from pipetrain.plan import PlannerConfig, Topology, make_plan
    from pipetrain.plan.profiler import profile_model

    reference = vision_model("unet")
    model = copy.deepcopy(reference)
    x, y = vision_batches("unet", 1)[0]
    captured = CapturedModel.create(model, (x,))
    profile = profile_model([captured.build(u) for u in range(len(captured))], x,
                            device="cpu", warmup=0, repetitions=1)
    assert len(profile.layers) == len(captured)
    plan = make_plan(profile, PlannerConfig(topology=Topology.flat(3, 1e9), straight=True))
    path = os.path.join(str(tmp_path), "plan.json")
    plan.save(path)
    config = config_from_plan(path, num_layers=len(captured))
    pipe = GPipe(model, example_inputs=(x,), balance=config.balance, chunks=2)
    assert pipe.balance == list(config.balance) and len(pipe.partitions) == 3
    output, expected = pipe(x), reference(x)
    assert float((output - expected).detach().abs().max()) < TOLERANCE
    F.mse_loss(output, y).backward()
    F.mse_loss(expected, y).backward()
    got, want = _grads(model), _grads(reference)
    assert max(float((got[n] - want[n]).abs().max()) for n in want) < TOLERANCE
