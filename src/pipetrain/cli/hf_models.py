"""``pipetrain train --model hf-gpt2|hf-llama``: a Hugging Face model, unmodified, as the run's model.

The model is built from a config sized by ``--layers --width --heads --context``
(``--dropout`` for GPT-2) with the byte vocabulary (256) of the default corpus: no
download. The pipeline captures it (:mod:`pipetrain.frontend`) and cuts it at block
boundaries, as evenly as the blocks allow (the first stage also holds the embeddings,
the last the head), or where the planner says (``--balance auto``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.cli.run_config import RunConfig

__all__ = [
    "HF_MODELS",
    "block_split_points",
    "build_hf_model",
    "hf_layout_problems",
    "hf_loss",
]

HF_MODELS = {"hf-gpt2": "transformer.h", "hf-llama": "model.layers"}
"""The Hugging Face models of ``--model``, and where their blocks live."""
VOCAB = 256


def build_hf_model(args: RunConfig) -> nn.Module:
    """The model of ``--model`` (seeded by ``--seed``; built on every rank alike).

    Raises:
        RuntimeError: transformers is not installed (the message shows the install line).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never a download
    try:
        import transformers
    except ImportError:
        raise RuntimeError(
            f"--model {args.model} needs Hugging Face transformers; fix: "
            "pip install -c constraints.txt -e '.[hf]'"
        ) from None
    torch.manual_seed(args.seed)
    if args.model == "hf-gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
            n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
            attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0)
        model: nn.Module = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=args.width, intermediate_size=4 * args.width,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, max_position_embeddings=args.context,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    return model


def block_split_points(args: RunConfig, num_stages: int) -> list[str]:
    """Where each stage after the first begins: blocks spread evenly over the stages.

    Example:
        >>> block_split_points(RunConfig(model="hf-gpt2", layers=6), 3)
        ['transformer.h.2', 'transformer.h.4']
    """
    prefix = HF_MODELS[args.model]
    return [f"{prefix}.{round(j * args.layers / num_stages)}" for j in range(1, num_stages)]


def hf_layout_problems(args: RunConfig) -> list[str]:
    """What ``--model hf-*`` does not take (flags named)."""
    problems = []
    stages = args.stages * (args.virtual or 1)
    if args.layers < stages and args.balance is None:
        problems.append(f"--layers {args.layers} cannot be cut into {stages} stages at block "
                        f"boundaries; fix: --layers {stages} or more, or --balance auto")
    if args.plan is not None or args.balance not in (None, "auto"):
        problems.append(
            f"--model {args.model} is cut at its blocks (default) or by the planner "
            "(--balance auto); --balance N,N,... and --plan count the layers of --model gpt"
        )
    return problems


def hf_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal language model's output (``output.logits``)."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())
