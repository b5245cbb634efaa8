"""A captured model follows ``.train()`` / ``.eval()``, and its random streams do not
depend on the cut.

Hugging Face GPT-2 with its default dropout (0.1 on embeddings, attention and residuals):
in eval mode the pipeline gives the unpipelined model's eval output (dropout and
attention dropout off); in training mode it draws dropout (its output differs), and the
masks are keyed by unit, so 2 and 4 partitions give the same output and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pipetrain import GPipe

pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=4,
                                      n_head=4, bos_token_id=0, eos_token_id=0))


def test_dropout_follows_the_mode_and_not_the_cut() -> None:
    model = _gpt2()
    x = torch.randint(0, 256, (4, 12))
    two = GPipe(copy.deepcopy(model), example_inputs=(x,), split_points=["transformer.h.2"], chunks=2)
    four = GPipe(copy.deepcopy(model), example_inputs=(x,), chunks=2,
                 split_points=["transformer.h.1", "transformer.h.2", "transformer.h.3"])
    two.eval()
    expected = model.eval()(x, use_cache=False).logits
    with torch.no_grad():
        assert float((two(x).logits - expected).abs().max()) < 1e-5
    two.train()
    torch.manual_seed(5)
    out_two = two(x).logits
    torch.manual_seed(5)
    out_four = four(x).logits
    assert float((out_two - expected).detach().abs().max()) > 1e-3  # dropout drew
    assert torch.equal(out_two, out_four)
    out_two.square().mean().backward()
    out_four.square().mean().backward()
    # partitions.<j>.<unit>.<the model's name>
    grads_two = {n.split(".", 3)[3]: p.grad for n, p in two.named_parameters()}
    grads_four = {n.split(".", 3)[3]: p.grad for n, p in four.named_parameters()}
    assert set(grads_two) == set(grads_four)
    for name, grad in grads_two.items():
        assert torch.allclose(grad, grads_four[name], atol=1e-6), name
