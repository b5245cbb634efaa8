"""``pipetrain sample RUN``: load a finished run's checkpoint in one process and sample text.

The checkpoint was written by K stage processes; here it loads into a single-stage
pipeline (checkpoints reshard to any number of stages).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``sample`` on the ``pipetrain`` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sample", help="sample text from a trained run's checkpoint",
        description="Load RUN/checkpoint (written by `pipetrain train --out RUN`) into one "
                    "process and print generated text.")
    parser.add_argument("run_folder", metavar="RUN", help="the run folder of `pipetrain train`")
    parser.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    parser.add_argument("--bytes", type=int, default=300, help="how many bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature: lower is more conservative, 0 always picks "
                             "the most likely byte (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40,
                        help="sample from the k most likely bytes only (default 40)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampling (default 0; the same seed gives the same text)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print a sample; 2 with a message when RUN is not a finished run."""
    config_path = os.path.join(args.run_folder, "config.json")
    checkpoint = os.path.join(args.run_folder, "checkpoint")
    if not os.path.isfile(config_path) or not os.path.isdir(checkpoint):
        sys.stderr.write(
            f"pipetrain sample: error: {args.run_folder!r} is not a finished run (it needs "
            "config.json and checkpoint/); fix: pass the --out folder of `pipetrain train`\n"
        )
        return 2
    import torch
    import torch.distributed as dist

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.data import ByteTokenizer
    from pipetrain.launch import free_port
    from pipetrain.models import GPTConfig, generate, gpt_layer_factories, gpt_loss, gpt_ties
    from pipetrain.runtime.process_group import init_distributed

    with open(config_path) as f:
        saved = json.load(f)
    model = GPTConfig(**saved["model"])
    context = init_distributed(rank=0, world_size=1, master_addr="127.0.0.1",
                               master_port=free_port(), backend="gloo")
    try:
        pipe = Pipeline(gpt_layer_factories(model, seed=0), loss_fn=gpt_loss,
                        optimizer=lambda p: torch.optim.AdamW(p), ties=gpt_ties(model),
                        config=PipelineConfig(num_stages=1, num_microbatches=1), context=context)
        pipe.load(checkpoint)
        tokenizer = ByteTokenizer()
        prompt = tokenizer.encode(args.prompt)

        def logits(ids: torch.Tensor) -> torch.Tensor:
            output = pipe.eval_step(ids)
            assert isinstance(output, torch.Tensor)
            return output

        tokens = generate(logits, prompt, num_tokens=args.bytes, temperature=args.temperature,
                          top_k=args.top_k, generator=torch.Generator().manual_seed(args.seed),
                          context=model.context)
        sys.stdout.write(tokenizer.decode(tokens.reshape(-1)) + "\n")
        pipe.close()
    finally:
        dist.destroy_process_group()
    return 0
