"""Tests of pipetrain.models.gpt: factories, ties, shapes, causality, training, sampling."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from pipetrain.data import TextDataset, load_corpus
from pipetrain.models.gpt import (
    Block,
    Embedding,
    GPTConfig,
    Head,
    build_gpt,
    count_parameters,
    generate,
    gpt_layer,
    gpt_layer_factories,
    gpt_loss,
    gpt_ties,
)

SMALL = GPTConfig(context=16, num_layers=2, width=32, num_heads=4)


def _parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = _parameters(a), _parameters(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# --- config ---------------------------------------------------------------------------


def test_config_reports_every_problem_with_a_fix() -> None:
    with pytest.raises(ValueError) as info:
        GPTConfig(vocab_size=0, context=-1, dropout=1.5)
    message = str(info.value)
    assert "vocab_size=0" in message and "context=-1" in message and "dropout=1.5" in message
    with pytest.raises(
        ValueError, match=r"width=100 is not divisible by num_heads=8: use num_heads=5 or width=104"
    ):
        GPTConfig(width=100, num_heads=8)


def test_config_is_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        SMALL.width = 8  # type: ignore[misc]


# --- factories and ties ---------------------------------------------------------------


def test_layers_are_embedding_blocks_head() -> None:
    layers = [factory() for factory in gpt_layer_factories(SMALL, seed=0)]
    assert [type(layer) for layer in layers] == [Embedding, Block, Block, Head]
    with pytest.raises(ValueError, match=r"index=4 is out of range.*layers 0\.\.3"):
        gpt_layer(SMALL, seed=0, index=4)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_factories_are_deterministic_in_any_order(tie_embeddings: bool) -> None:
    config = GPTConfig(context=16, num_layers=3, width=32, tie_embeddings=tie_embeddings)
    factories = gpt_layer_factories(config, seed=7)
    first = [factory() for factory in factories]
    torch.manual_seed(1234)
    torch.randn(1000)  # consumed caller RNG must not matter
    reversed_order = [factory() for factory in reversed(factories)][::-1]
    fresh_list = [factory() for factory in gpt_layer_factories(config, seed=7)]
    unpickled = [factory() for factory in pickle.loads(pickle.dumps(factories))]
    for a, b, c, d in zip(first, reversed_order, fresh_list, unpickled):
        _assert_same_parameters(a, b)
        _assert_same_parameters(a, c)
        _assert_same_parameters(a, d)


def test_factories_leave_caller_rng_untouched() -> None:
    torch.manual_seed(99)
    state = torch.get_rng_state()
    build_gpt(SMALL, seed=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_different_seeds_and_layers_differ() -> None:
    a = gpt_layer(SMALL, seed=0, index=1)
    b = gpt_layer(SMALL, seed=1, index=1)
    c = gpt_layer(SMALL, seed=0, index=2)
    assert not torch.equal(a.attn.qkv.weight, b.attn.qkv.weight)
    assert not torch.equal(a.attn.qkv.weight, c.attn.qkv.weight)


def test_build_gpt_equals_factories_parameter_by_parameter() -> None:
    model = build_gpt(SMALL, seed=3)
    layers = [factory() for factory in gpt_layer_factories(SMALL, seed=3)]
    assert len(model) == len(layers)
    for built, layer in zip(model, layers):
        _assert_same_parameters(built, layer)


def test_tied_weights_are_shared_in_build_and_equal_in_factories() -> None:
    assert gpt_ties(SMALL) == [((0, "token.weight"), (3, "proj.weight"))]
    model = build_gpt(SMALL, seed=0)
    assert model[0].token.weight is model[3].proj.weight
    untied = dataclasses.replace(SMALL, tie_embeddings=False)
    untied_count = count_parameters(build_gpt(untied, seed=0))
    assert count_parameters(model) == untied_count - SMALL.vocab_size * SMALL.width

    factories = gpt_layer_factories(SMALL, seed=0)
    embedding, head = factories[0](), factories[-1]()
    assert embedding.token.weight is not head.proj.weight
    assert torch.equal(embedding.token.weight, head.proj.weight)


def test_untied_config_has_no_ties_and_distinct_weights() -> None:
    config = GPTConfig(context=16, num_layers=2, width=32, tie_embeddings=False)
    assert gpt_ties(config) == []
    model = build_gpt(config, seed=0)
    assert not torch.equal(model[0].token.weight, model[3].proj.weight)


def test_default_config_size() -> None:
    assert count_parameters(build_gpt(GPTConfig(), seed=0)) == 842_496


@pytest.mark.parametrize("config", [
    GPTConfig(), SMALL, dataclasses.replace(SMALL, tie_embeddings=False),
    GPTConfig(vocab_size=50, context=7, num_layers=3, width=24, num_heads=3),
])
def test_the_parameter_formula_counts_the_built_model(config: GPTConfig) -> None:
    assert config.parameters == count_parameters(build_gpt(config, seed=0))


# --- forward ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_shapes_for_any_length_up_to_context(num_tokens: int) -> None:
    model = build_gpt(SMALL, seed=0)
    tokens = torch.randint(0, 256, (3, num_tokens))
    hidden = model[0](tokens)
    assert hidden.shape == (3, num_tokens, 32) and hidden.dtype == torch.float32
    assert model[1](hidden).shape == (3, num_tokens, 32)
    assert model(tokens).shape == (3, num_tokens, 256)


def test_causality_future_tokens_do_not_change_earlier_logits() -> None:
    model = build_gpt(SMALL, seed=0)
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_too_long_input_raises_with_fix() -> None:
    model = build_gpt(SMALL, seed=0)
    with pytest.raises(
        ValueError, match=r"17 tokens but the model's context is 16.*tokens\[:, -16:\].*context=17"
    ):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_float_or_1d_input_raises() -> None:
    model = build_gpt(SMALL, seed=0)
    with pytest.raises(TypeError, match=r"integer token ids of shape \(batch, tokens\)"):
        model(torch.zeros(1, 4))
    with pytest.raises(TypeError, match=r"shape \(4,\)"):
        model(torch.zeros(4, dtype=torch.long))


def test_loss_is_mean_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    expected = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(gpt_loss(logits, targets), expected)
    assert math.isclose(
        gpt_loss(torch.zeros(1, 4, 256), torch.zeros(1, 4, dtype=torch.long)).item(),
        math.log(256),
        rel_tol=1e-6,
    )
    with pytest.raises(
        ValueError, match=r"logits of shape \(2, 3, 5\) do not match targets of shape \(2, 4\)"
    ):
        gpt_loss(logits, torch.zeros(2, 4, dtype=torch.long))


def test_training_on_default_corpus_lowers_loss() -> None:
    torch.manual_seed(0)
    config = GPTConfig(context=64, num_layers=2, width=64, num_heads=4)
    dataset = TextDataset(load_corpus(max_bytes=1_000_000), context=64, seed=0)
    model = build_gpt(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(200):
        inputs, targets = dataset.batch(step, 16)
        loss = gpt_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # about ln(256) = 5.55 at initialization
    assert sum(losses[-10:]) / 10 < 3.0  # measured ~2.3
    with torch.no_grad():
        inputs, targets = dataset.batch(0, 64, split="val")
        assert gpt_loss(model(inputs), targets).item() < 3.2  # held-out text, measured ~2.2


# --- sampling ---------------------------------------------------------------------------


def test_generate_length_and_determinism() -> None:
    model = build_gpt(SMALL, seed=0)
    prompt = torch.tensor([104, 101, 108])
    a = generate(model, prompt, num_tokens=40, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, num_tokens=40, generator=torch.Generator().manual_seed(1))
    c = generate(model, prompt, num_tokens=40, generator=torch.Generator().manual_seed(2))
    assert a.shape == (43,)  # longer than the context: the input is cropped
    assert torch.equal(a[:3], prompt)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    batched = generate(model, prompt.repeat(2, 1), num_tokens=5, top_k=3)
    assert batched.shape == (2, 8)


def test_generate_greedy_and_callable_with_explicit_context() -> None:
    model = build_gpt(SMALL, seed=0)
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, num_tokens=20, temperature=0.0)
    seen_lengths: list[int] = []

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        seen_lengths.append(tokens.size(1))
        return model(tokens)

    assert torch.equal(
        generate(forward, prompt, num_tokens=20, temperature=0.0, context=16), greedy
    )
    assert max(seen_lengths) == 16
    expected_next = model(prompt)[0, -1].argmax()
    assert greedy[0, 3] == expected_next


def test_generate_top_k_one_is_greedy() -> None:
    model = build_gpt(SMALL, seed=0)
    prompt = torch.tensor([5, 6])
    greedy = generate(model, prompt, num_tokens=8, temperature=0.0)
    top1 = generate(
        model, prompt, num_tokens=8, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(greedy, top1)


def test_generate_rejects_bad_arguments_all_at_once() -> None:
    model = build_gpt(SMALL, seed=0)
    with pytest.raises(ValueError) as info:
        generate(model, torch.zeros(0, dtype=torch.long), num_tokens=-1, temperature=-1.0, top_k=0)
    message = str(info.value)
    for part in ("prompt must be non-empty", "num_tokens=-1", "temperature=-1.0", "top_k=0"):
        assert part in message
