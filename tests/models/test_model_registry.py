"""Tests of pipetrain.models.registry."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models import MODELS, GPTConfig, build_gpt, get_model_factories, get_model_ties


def test_registry_names() -> None:
    assert set(MODELS) >= {"gpt", "mlp", "resnet"}


def test_gpt_from_registry_matches_build_gpt() -> None:
    factories = get_model_factories("gpt", seed=1, num_layers=1, width=32, context=8)
    reference = build_gpt(GPTConfig(num_layers=1, width=32, context=8), seed=1)
    assert len(factories) == 3
    assert torch.equal(factories[1]().attn.qkv.weight, reference[1].attn.qkv.weight)
    assert get_model_ties("gpt", num_layers=1) == [((0, "token.weight"), (2, "proj.weight"))]
    assert get_model_ties("gpt", tie_embeddings=False) == []


def test_other_models_and_unknown_name() -> None:
    assert len(get_model_factories("mlp", seed=0, width=8, depth=5)) == 5
    assert len(get_model_factories("resnet", seed=0, widths=(8,), num_blocks=1)) == 4
    assert get_model_ties("mlp") == []
    with pytest.raises(
        ValueError, match=r"unknown model 'vgg': choose one of \['gpt', 'mlp', 'resnet'\]"
    ):
        get_model_factories("vgg", seed=0)
