"""Bad input to the frontend gets an error that names the bad value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain import GPipe
from pipetrain.frontend import CapturedModel, CaptureError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # branches on a tensor's value
            return x * 2
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.proj(x))


X = torch.randn(3, 4)


def _create(split_points: list[str], num_stages: int = 2) -> CapturedModel:
    return CapturedModel.create(Net(), (X,), split_points=split_points, num_stages=num_stages)


def test_split_point_that_names_no_module() -> None:
    with pytest.raises(ValueError, match=r"split point 'blocks\.7' names no module of Net "
                                         r"\(did you mean .*'blocks\.1'"):
        _create(["blocks.7"])


def test_split_point_of_a_module_that_never_runs() -> None:
    with pytest.raises(ValueError, match="'unused' names a module that runs no operation"):
        _create(["unused"])


def test_split_points_out_of_order() -> None:
    with pytest.raises(ValueError, match=r"out of order.*fix: list them in the order the model "
                                         r"runs them: \['blocks.0', 'blocks.2'\]"):
        _create(["blocks.2", "blocks.0"], num_stages=3)


def test_more_split_points_than_stages() -> None:
    with pytest.raises(ValueError, match="more split points than the pipeline's stages allow: "
                                         "2 split points make 3 stages, the pipeline has 2"):
        _create(["blocks.0", "blocks.2"], num_stages=2)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as error:
        _create(["nope", "blocks.1", "head"], num_stages=3)
    assert "more split points" in str(error.value) and "'nope' names no module" in str(error.value)


def test_split_point_at_the_first_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="'stem' begins at the model's first operation"):
        _create(["stem"])


def test_data_dependent_control_flow_names_the_layer_and_the_fix() -> None:
    with pytest.raises(CaptureError) as error:
        CapturedModel.create(Gated(), (X,), split_points=None)
    message = str(error.value)
    assert "layer 'gate' (Gate)" in message
    assert "if x.sum() > 0" in message
    assert "torch.where" in message and "nn.Sequential" in message


def test_example_inputs_that_do_not_fit_the_model() -> None:
    with pytest.raises(CaptureError) as error:
        CapturedModel.create(Net(), (torch.randn(3, 5),))
    message = str(error.value)
    assert "example inputs (x: (3, 5) float32)" in message
    assert "layer 'stem' (Linear)" in message and "fix: pass example_inputs" in message


def test_example_inputs_that_do_not_fit_the_signature() -> None:
    with pytest.raises(TypeError, match=r"example inputs do not match Net.forward\(x"):
        CapturedModel.create(Net(), (X, X))


def test_example_inputs_without_a_tensor() -> None:
    with pytest.raises(TypeError, match="hold no tensor"):
        CapturedModel.create(Net(), (3,))


def test_a_module_without_example_inputs() -> None:
    from pipetrain import Pipeline

    with pytest.raises(TypeError, match=r"Net is not an nn.Sequential.*example_inputs=\(batch,\)"):
        Pipeline(Net(), loss_fn=torch.nn.functional.mse_loss,  # checked before the job
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(TypeError, match=r"nn\.Sequential") as error:  # torchgpipe's error
        GPipe(Net(), chunks=2)
    assert any("example_inputs=(batch,)" in note for note in error.value.__notes__)


def test_a_batch_that_does_not_match_the_capture() -> None:
    captured = CapturedModel.create(Net(), (X,), split_points=["blocks.1"], num_stages=2)
    first = captured.build(0)
    with pytest.raises(ValueError, match=r"missing x \(captured as \(3, 4\) float32\)"):
        first({"y": X})


def test_use_cache_true_is_refused_with_the_fix() -> None:
    pytest.importorskip("transformers")
    from helpers.frontend_jobs import hf_model

    tokens = torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=r"use_cache=True.*fix: example_kwargs=\{'use_cache': False\}"):
        CapturedModel.create(hf_model("gpt2"), (tokens,), {"use_cache": True})


def test_weights_for_a_model_that_is_not_on_meta() -> None:
    with pytest.raises(ValueError, match="meta device"):
        CapturedModel.create(Net(), (X,), weights="model.safetensors")
