"""Tests for pipetrain.plan.profiler and .measure: what each field counts, on the CPU."""

from __future__ import annotations

import doctest
import functools
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipetrain
import pipetrain.plan
import pipetrain.plan.layer_costs
import pipetrain.plan.measure
import pipetrain.plan.memory
import pipetrain.plan.profiler
import pipetrain.plan.profiler_inputs
from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss
from pipetrain.partition import solve
from pipetrain.plan import Profile
from pipetrain.plan.profiler import profile_model

F32 = 4  # bytes per float32


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Time on one thread: on a shared 2-core machine, two threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quick(layers: object, sample: object, **options: object) -> Profile:
    settings: dict[str, object] = {"device": "cpu", "warmup": 1, "repetitions": 3, **options}
    return profile_model(layers, sample, **settings)  # type: ignore[arg-type]


def test_bytes_are_exact_for_linear_and_relu() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    profile = quick(model, torch.randn(5, 8), optimizer="adam")
    params = [(8 * 16 + 16) * F32, 0, (16 * 4 + 4) * F32, (4 * 4 + 4) * F32]
    assert [layer.parameter_bytes for layer in profile.layers] == params
    assert [layer.gradient_bytes for layer in profile.layers] == params
    assert [layer.optimizer_bytes for layer in profile.layers] == [2 * p for p in params]
    assert [layer.output_bytes for layer in profile.layers] == [
        5 * 16 * F32, 5 * 16 * F32, 5 * 4 * F32, 5 * 4 * F32]
    # Linear saves its input (the sample); ReLU its output; the next Linear's input is
    # that output, already counted; the last Linear's input is a Linear's output, which
    # nothing counted yet.
    assert [layer.saved_bytes for layer in profile.layers] == [
        5 * 8 * F32, 5 * 16 * F32, 0, 5 * 4 * F32]
    assert [layer.description for layer in profile.layers][:2] == [
        "Linear(in_features=8, out_features=16, bias=True)", "ReLU"]
    assert (profile.batch_size, profile.optimizer, profile.dtype) == (5, "adam", "float32")


def test_saved_bytes_of_an_in_place_layer() -> None:
    # ReLU(inplace=True) writes to its input (the Linear's output, which the Linear does
    # not keep) and saves it: counted once, by the ReLU; the next Linear then counts 0.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    profile = quick(model, torch.randn(3, 4, requires_grad=True))
    assert [layer.saved_bytes for layer in profile.layers] == [3 * 4 * F32, 3 * 8 * F32, 0]


@pytest.mark.parametrize(
    ("optimizer", "name", "factor"),
    [("sgd", "sgd", 0), ("adamw", "adamw", 2),
     (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), "sgd", 1)],
)
def test_optimizer_bytes(optimizer: object, name: str, factor: int) -> None:
    frozen = nn.Linear(8, 4)
    frozen.bias.requires_grad_(False)
    profile = quick([nn.Linear(4, 8), frozen], torch.randn(3, 4), optimizer=optimizer)
    assert profile.optimizer == name
    assert profile.layers[0].optimizer_bytes == factor * (4 * 8 + 8) * F32
    # the frozen bias has parameter bytes but no gradient and no optimizer state
    assert profile.layers[1].parameter_bytes == (4 * 8 + 4) * F32
    assert profile.layers[1].gradient_bytes == 4 * 8 * F32
    assert profile.layers[1].optimizer_bytes == factor * 4 * 8 * F32


def test_a_wide_layer_takes_longer_and_the_backward_halves_add_up() -> None:
    # layer 1 does 16x the multiply-adds of layer 0
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1024), nn.ReLU())
    profile = quick(model, torch.randn(64, 64), warmup=2, repetitions=5)
    thin, wide, relu = profile.layers
    assert wide.forward_s > thin.forward_s and wide.backward_s > thin.backward_s
    for layer in profile.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0
    assert wide.backward_input_s is not None and wide.backward_weight_s is not None
    assert wide.backward_input_s > 0 and wide.backward_weight_s > 0
    assert 0.25 * wide.backward_s < wide.backward_input_s + wide.backward_weight_s < 4 * wide.backward_s
    assert (relu.backward_input_s, relu.backward_weight_s) == (relu.backward_s, 0.0)
    # the optimizer's step over each layer's parameters; a layer without parameters has
    # none (on a shared CPU the two steps' times are too close to order reliably)
    assert wide.optimizer_step_s is not None and thin.optimizer_step_s is not None
    assert wide.optimizer_step_s > 0 and thin.optimizer_step_s > 0
    assert relu.optimizer_step_s == 0.0


def test_the_same_model_gives_the_same_plan_twice() -> None:
    def thin() -> nn.Module:
        return nn.Linear(64, 64)

    def fat() -> nn.Module:  # 64x the multiply-adds of a thin layer
        return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 64))

    # Three thin layers take well under one fat one (their autograd overhead included),
    # so the best plan, each fat layer alone, is robust to noise; equal costs would
    # give [2, 2, 2, 2].
    factories = [fat, thin, thin, thin, fat, thin, thin, thin]
    sample = torch.randn(64, 64)
    balances = [
        solve([layer.compute_s for layer in quick(factories, sample, warmup=2,
                                                 repetitions=5).layers], 4)
        for _ in range(2)
    ]
    assert balances == [[1, 3, 1, 3], [1, 3, 1, 3]]
    assert solve([1.0] * 8, 4) == [2, 2, 2, 2]


def test_json_round_trip(tmp_path: Path) -> None:
    profile = quick(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(8, 4),
                    microbatch_size=2)
    assert Profile.from_json(profile.to_json()) == profile
    profile.save(tmp_path / "profile.json")
    loaded = Profile.load(tmp_path / "profile.json")
    assert loaded == profile
    assert loaded.microbatch_size == 2 and loaded.torch_version == torch.__version__
    assert loaded.metadata["repetitions"] == 3
    for layer in loaded.layers:
        times = [layer.microbatch_forward_s, layer.microbatch_backward_s,
                 layer.microbatch_backward_input_s, layer.microbatch_backward_weight_s]
        assert all(t is not None and t >= 0 for t in times)
    assert loaded.layers[1].microbatch_backward_weight_s == 0.0


def test_without_microbatch_size_no_microbatch_times() -> None:
    profile = quick([nn.Linear(4, 4)], torch.randn(8, 4), batch_size=6)
    assert profile.microbatch_size is None and profile.batch_size == 6
    assert profile.layers[0].microbatch_forward_s is None
    assert profile.layers[0].output_bytes == 6 * 4 * F32
    assert "microbatch_forward_s" not in profile.to_json()


def test_factories_are_built_and_freed_one_at_a_time() -> None:
    events: list[str] = []

    def factory(index: int) -> nn.Module:
        events.append(f"built {index}")
        layer = nn.Linear(4, 4)
        weakref.finalize(layer, events.append, f"freed {index}")
        return layer

    quick([functools.partial(factory, i) for i in range(3)], torch.randn(2, 4),
          microbatch_size=1)
    assert events == ["built 0", "freed 0", "built 1", "freed 1", "built 2", "freed 2"]


def test_the_given_module_is_left_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 4)
    rng = torch.get_rng_state()
    quick(model, sample, optimizer="adam")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)


class Gate(nn.Module):
    """Nested in and out: {"x", "mask", "scale"} -> (h, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, batch: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask, scale = batch["x"], batch["mask"], batch["scale"]
        assert isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor)
        return self.linear(x) * float(scale), mask  # type: ignore[arg-type]


class Masked(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = pair
        return h * mask


def test_nested_inputs_and_outputs() -> None:
    sample = {"x": torch.randn(6, 4), "mask": torch.ones(6, 4), "scale": 2.0}
    profile = quick([Gate(), Masked()], sample, microbatch_size=3)
    gate, masked = profile.layers
    assert gate.output_bytes == 2 * 6 * 4 * F32
    assert masked.output_bytes == 6 * 4 * F32
    assert masked.backward_s > 0 and masked.backward_weight_s == 0.0
    assert gate.saved_bytes == 6 * 4 * F32  # the Linear's input x
    # h * mask saves mask (for h's gradient), not h (mask needs none)
    assert masked.saved_bytes == 6 * 4 * F32


def test_the_last_layer_runs_loss_fn_at_both_sizes() -> None:
    rows: list[int] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows.append(target.size(0))
        return F.mse_loss(output, target)

    profile = quick([nn.Linear(4, 4), nn.Linear(4, 2)], torch.randn(8, 4),
                    loss_fn=loss_fn, target=torch.randn(8, 2), microbatch_size=2)
    assert set(rows) == {8, 2}
    assert profile.layers[1].backward_s > 0


def test_a_tiny_gpt_with_its_loss_and_tied_weights() -> None:
    config = GPTConfig(num_layers=1, width=16, context=8, vocab_size=32)
    tokens = torch.randint(32, (4, 8))
    profile = quick(gpt_layer_factories(config, seed=0), tokens, loss_fn=gpt_loss,
                    target=torch.randint(32, (4, 8)), dtype=torch.float64)
    embedding, block, head = profile.layers
    assert profile.dtype == "float64"
    assert head.output_bytes == 4 * 8 * 32 * 8  # logits in float64
    # the tied token / output weight (32 x 16) counts in both layers that hold it
    assert embedding.parameter_bytes == (32 * 16 + 8 * 16) * 8
    assert head.parameter_bytes == (32 * 16 + 2 * 16) * 8
    assert block.saved_bytes > 0 and head.saved_bytes > 0


def test_empty_layers() -> None:
    with pytest.raises(ValueError, match="layers is empty"):
        profile_model([], torch.randn(2, 2))


def test_a_layer_that_rejects_its_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"layer 0 \(Linear.*Tensor\(float32, \(3, 5\)\)"):
        quick(nn.Sequential(nn.Linear(8, 4)), torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"layer 1 \(Linear.*Tensor\(float32, \(3, 4\)\)"):
        quick(nn.Sequential(nn.Linear(5, 4), nn.Linear(8, 4)), torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"layer 0 .*\{'ids': Tensor\(int64, \(2,\)\)"):
        quick([nn.Linear(2, 2)], {"ids": torch.zeros(2, dtype=torch.long)})


def test_bad_settings_are_reported_together() -> None:
    with pytest.raises(ValueError) as error:
        profile_model([nn.Linear(2, 2)], torch.randn(4, 2), warmup=-1, repetitions=0,
                      optimizer="lamb", microbatch_size=5, target=torch.zeros(4))
    message = str(error.value)
    for part in ("warmup=-1", "repetitions=0", "'lamb'", "microbatch_size=5", "without loss_fn"):
        assert part in message
    with pytest.raises(ValueError, match=r"batch_size=9 must be an int in 1\.\.4"):
        profile_model([nn.Linear(2, 2)], torch.randn(4, 2), batch_size=9)


def test_bad_layers_and_loss() -> None:
    with pytest.raises(TypeError, match=r"layers\[1\] is a str"):
        profile_model([nn.Linear(2, 2), "relu"], torch.randn(4, 2))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got one Linear"):
        profile_model(nn.Linear(2, 2), torch.randn(4, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned a int"):
        quick([lambda: 3], torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(4, 2\)"):
        quick([nn.Linear(2, 2)], torch.randn(4, 2), loss_fn=lambda out, y: out - y,
              target=torch.randn(4, 2))


def test_a_layer_that_fails_on_a_micro_batch_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # needs 2 rows in training
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm1d.*micro-batch Tensor\(float32, "
                                         r"\(1, 4\)\).*a larger microbatch_size"):
        quick(model, torch.randn(4, 4), microbatch_size=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda() -> None:
    profile = profile_model(nn.Sequential(nn.Linear(256, 256), nn.ReLU()), torch.randn(32, 256),
                            device="cuda", optimizer="adam", microbatch_size=8)
    assert profile.device.startswith("cuda") and "device_name" in profile.metadata
    linear, relu = profile.layers
    assert linear.optimizer_bytes == 2 * linear.parameter_bytes == 2 * (256 * 257) * F32
    assert relu.saved_bytes == relu.output_bytes == 32 * 256 * F32
    assert linear.forward_s > 0 and linear.backward_weight_s is not None


def test_the_plan_package_names_the_profiler() -> None:
    assert pipetrain.plan.profile_model is profile_model


def test_importing_the_plan_package_does_not_import_torch() -> None:
    source = Path(pipetrain.__file__).resolve().parents[1]
    program = "import sys, pipetrain.plan; print('torch' in sys.modules)"
    completed = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(source)}, check=True,
    )
    assert completed.stdout.strip() == "False"


@pytest.mark.parametrize(
    "module", [pipetrain.plan.measure, pipetrain.plan.memory, pipetrain.plan.profiler,
               pipetrain.plan.profiler_inputs, pipetrain.plan.layer_costs])
def test_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0



def test_the_caches_are_flushed_only_before_steps_larger_than_a_cores_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Flushing writes twice the last-level cache (tens of ms); a step whose parameters,
    gradients and state fit in a core's cache is timed without it."""
    from pipetrain.plan.measure import time_optimizer_step

    fills: list[int] = []

    class Buffer:
        def fill_(self, value: int) -> None:
            fills.append(value)

    monkeypatch.setattr(pipetrain.plan.measure, "core_cache_bytes", lambda: 1 << 20)
    for width, expected in ((8, []), (512, [1, 2])):  # 4 x 0.5 MiB with AdamW's two states
        layer = nn.Linear(256, width)
        layer(torch.ones(2, 256)).sum().backward()
        fills.clear()
        samples = time_optimizer_step(list(layer.parameters()), torch.optim.AdamW,
                                      device=torch.device("cpu"), warmup=1, repetitions=2,
                                      flush=Buffer())  # type: ignore[arg-type]
        assert len(samples) == 2 and fills == expected, width
