"""Unmodified Hugging Face encoders, and models whose code pins the batch size, under
micro-batching.

BERT-style models expand a ``token_type_ids`` buffer to the batch and take their inputs
through ``forward(..., **kwargs)``. Captured with a symbolic batch, they train in a
2-rank ``Pipeline`` (gpipe and 1f1b, 2 and 4 micro-batches, batches of 8, 7 and 5 rows,
so uneven micro-batches and micro-batches of 1 row) to the losses and weights of plain
single-process training; ``GPipe`` (one process, 4 chunks) gives the unpipelined outputs
and gradients. A model whose Python pins the batch size is captured again for each
micro-batch size it meets (same results); one that cannot run at a micro-batch's size
is refused with the sizes and the fix.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from helpers.distributed import run_workers
from helpers.frontend_jobs import (
    ENCODER_SPLITS,
    encoder_model,
    encoder_parity_job,
    encoder_reference,
)
from pipetrain import GPipe
from pipetrain.frontend import CapturedModel, CaptureError

pytest.importorskip("transformers")

STEPS = 3
TOLERANCE = 1e-5


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """By the model's names (GPipe's are partitions.<j>.<unit>.<the model's name>)."""
    strip = isinstance(module, GPipe)
    return {n.split(".", 3)[3] if strip else n: p.grad
            for n, p in module.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def test_bert_is_captured_with_a_symbolic_batch() -> None:
    model = encoder_model("bert-mlm")
    captured = CapturedModel.create(model, (torch.randint(2, 64, (8, 10)),))
    assert captured.plan.captured.dynamic
    sizes = captured.plan.captured.sizes
    assert sizes.why_not(((2, 10),)) is None and sizes.why_not(((3, 7),)) is None
    assert sizes.why_not(((2, 65),)) is not None  # 64 positions


@pytest.mark.parametrize("kind", sorted(ENCODER_SPLITS))
def test_gpipe_of_an_encoder_matches_the_model(kind: str) -> None:
    model = encoder_model(kind)
    x = torch.randint(2, 64, (8, 10))
    pipe = GPipe(copy.deepcopy(model), example_inputs=(x,), split_points=ENCODER_SPLITS[kind],
                 chunks=4)
    for rows in (8, 7):  # 4 micro-batches of 2; then 2, 2, 2 and 1
        expected = model(x[:rows]).logits
        output = pipe(x[:rows]).logits
        assert float((output - expected).detach().abs().max()) < TOLERANCE, (kind, rows)
        expected.square().mean().backward()
        output.square().mean().backward()
        reference, got = _gradients(model), _gradients(pipe)
        assert set(got) <= set(reference) and len(got) > 0
        for name, grad in got.items():
            assert torch.allclose(grad, reference[name], atol=1e-6), (kind, rows, name)
        model.zero_grad()
        pipe.zero_grad()


class RowLoop(nn.Module):
    """Runs its first layer row by row: the capture unrolls the loop, pinning the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.stack([self.first(x[i]) for i in range(x.shape[0])])
        return self.second(rows.relu())


class SizeBranch(nn.Module):
    """Negates its hidden values for batches of more than 4 rows: the graph captured on 8
    rows serves 5 or more only (2 rows would take the wrong branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if x.shape[0] > 4:
            hidden = -hidden
        return self.second(hidden.relu())


class ExtraLayerForLargeBatches(nn.Module):
    """Runs a layer for batches of more than 4 rows only: other units at other sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if x.shape[0] > 4:
            hidden = self.extra(hidden)
        return self.second(hidden)


class PerRowBias(nn.Module):
    """Adds a bias per row of an 8-row batch: it runs on 8 rows only."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        self.register_buffer("row_bias", torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) + self.row_bias)


@pytest.mark.parametrize("build", [RowLoop, SizeBranch])
def test_a_model_that_pins_the_batch_size_is_captured_per_micro_batch_size(
        build: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = build()
    x = torch.randn(8, 4)
    pipe = GPipe(copy.deepcopy(model), example_inputs=(x,), split_points=["second"], chunks=4)
    captured: Any = pipe.partitions[0][0].source  # the CapturedModel behind the units
    for rows in (8, 7, 6):  # micro-batches of 2; 2, 2, 2, 1; 2, 2, 1, 1
        output = pipe(x[:rows])
        # the model run on each micro-batch (SizeBranch's output depends on the batch size)
        expected = torch.cat([model(chunk) for chunk in x[:rows].tensor_split(4)])
        assert torch.allclose(output, expected, atol=1e-6)
        output.sum().backward()
        expected.sum().backward()
        for name, grad in _gradients(pipe).items():
            assert torch.allclose(grad, _gradients(model)[name], atol=1e-6), name
        model.zero_grad()
        pipe.zero_grad()
    assert sorted(captured.plans) == [((1, 4),), ((2, 4),)]  # the example's serves 8 rows


@pytest.mark.parametrize("build,why", [
    (PerRowBias, "x dim 0 is 2, captured fixed at 8"),
    (ExtraLayerForLargeBatches, "runs different layers: its graph there has 2 units"),
])
def test_a_model_that_cannot_run_at_the_micro_batch_size_is_refused(
        build: type[nn.Module], why: str) -> None:
    x = torch.randn(8, 4)
    pipe = GPipe(build(), example_inputs=(x,), split_points=["second"], chunks=4)
    with pytest.raises(CaptureError) as error:
        pipe(x)
    message = str(error.value)
    assert "x (2, 4)" in message and why in message, message
    assert "num_microbatches" in message and "example_inputs" in message


def _configs() -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [
        {"kind": "bert-mlm", "schedule": schedule, "num_stages": 2, "num_microbatches": m}
        for schedule in ("gpipe", "1f1b") for m in (2, 4)]
    configs += [
        {"kind": "bert-mlm", "masked": True, "schedule": "1f1b", "num_stages": 2,
         "num_microbatches": 4},
        {"kind": "bert-cls", "schedule": "1f1b", "num_stages": 2, "num_microbatches": 4},
        {"kind": "bert-cls", "schedule": "gpipe", "num_stages": 2, "num_microbatches": 2},
        {"kind": "roberta-mlm", "schedule": "1f1b", "num_stages": 2, "num_microbatches": 4},
        {"kind": "distilbert-mlm", "schedule": "gpipe", "num_stages": 2, "num_microbatches": 4},
    ]
    return configs


@pytest.mark.distributed
@pytest.mark.slow
def test_encoders_in_a_pipeline_match_single_process_training() -> None:
    configs = _configs()
    results = run_workers(encoder_parity_job, 2, configs, STEPS, timeout=600)
    failures = []
    for c, config in enumerate(configs):
        ref_state, ref_losses = encoder_reference(config["kind"], STEPS,
                                                  masked=bool(config.get("masked")))
        merged: dict[str, torch.Tensor] = {}
        for rank_results in results:
            merged.update(rank_results[c]["state"])
        assert set(merged) == set(ref_state), f"{config}: {set(merged) ^ set(ref_state)}"
        worst = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
        loss_error = max(abs(a - b) for a, b in zip(results[0][c]["losses"], ref_losses))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: |param diff| {worst:.2e}, |loss diff| {loss_error:.2e}")
        # the batch stays symbolic: only micro-batches of 1 row need a capture of their own
        single = [((1, 7), (1, 7))] if config.get("masked") else [((1, 7),)]
        expected = single if config["num_microbatches"] == 4 else []
        for rank_results in results:
            assert rank_results[c]["captures"] == expected, config
    assert not failures, "\n".join(failures)


def test_a_meta_model_made_real_stage_by_stage_is_captured_again_on_meta() -> None:
    with torch.device("meta"):
        model = encoder_model("bert-mlm")
    x = torch.randint(2, 64, (8, 10))
    captured = CapturedModel.create(model, (x,), split_points=ENCODER_SPLITS["bert-mlm"],
                                    num_stages=2)
    num_units = len(captured)
    units = {num_units - 1: captured.build(num_units - 1)}  # a rank with the last stage only
    assert {p.device.type for p in model.parameters()} == {"cpu", "meta"}
    assert captured.plan_for(((1, 10),)).num_units == num_units  # captured on meta
    units.update({u: captured.build(u) for u in range(num_units - 1)})
    value: Any = x[:1]
    for u in range(num_units):
        value = units[u](value)
    expected = model(x[:1]).logits  # every tensor of the model is real now
    assert float((value.logits - expected).detach().abs().max()) < TOLERANCE
