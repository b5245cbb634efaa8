"""``pipetrain sample RUN``: load a finished run's checkpoint in one process and sample text.

The checkpoint was written by K stage processes; here it loads into a single-stage
pipeline of the run's own model, whatever ``--model`` it trained (checkpoints reshard to
any number of stages), and the run's tokenizer turns the prompt and the sample into text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pipetrain.cli.run_config import RunConfig

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``sample`` on the ``pipetrain`` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sample", help="sample text from a trained run's checkpoint",
        description="Load RUN/checkpoint (written by `pipetrain train --out RUN`) into one "
                    "process and print generated text.")
    parser.add_argument("run_folder", metavar="RUN", help="the run folder of `pipetrain train`")
    parser.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    parser.add_argument("--bytes", type=int, default=300,
                        help="how many tokens to generate (bytes, for byte-level models)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature: lower is more conservative, 0 always picks "
                             "the most likely byte (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40,
                        help="sample from the k most likely bytes only (default 40)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampling (default 0; the same seed gives the same text)")
    parser.set_defaults(run=run)
    return parser


def _run_config(run_folder: str) -> RunConfig:
    """The run's resolved options, as one process samples it (one stage)."""
    from pipetrain.cli.train_resolve import saved_options

    config = RunConfig()
    saved = {k: v for k, v in saved_options(run_folder).items() if k in RunConfig.option_names()}
    if saved.get("stage_replicas") is not None:
        saved["stage_replicas"] = tuple(saved["stage_replicas"])
    config.set("resumed run", **saved)
    return config.replace("resumed run", stages=1, replicas=1, virtual=1, balance=None,
                          plan=None, stage_replicas=None, schedule="1f1b", microbatches=1)


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
    import torch.distributed as dist

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.cli.model_record import gpt_config_of
    from pipetrain.cli.run_model import pipeline_model, run_dataset, sample_text
    from pipetrain.cli.train_optimizer import training_factories
    from pipetrain.launch import free_port
    from pipetrain.runtime.process_group import init_distributed

    with open(config_path) as f:
        model_config = gpt_config_of(json.load(f)["model"])
    config = _run_config(args.run_folder)
    dataset, tokenizer = run_dataset(config)
    context = init_distributed(rank=0, world_size=1, master_addr="127.0.0.1",
                               master_port=free_port(), backend="gloo")
    try:
        model, arguments = pipeline_model(config, model_config, dataset,
                                          vocab_size=tokenizer.vocab_size, num_stages=1)
        # the run's own optimizer and schedule: the checkpoint holds their state
        optimizer, lr_scheduler, _ = training_factories(config, arguments)
        pipe = Pipeline(model, **arguments, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        config=PipelineConfig(num_stages=1, num_microbatches=1), context=context)
        pipe.load(checkpoint, set_aside=False)  # a training job may be writing it
        text = sample_text(pipe, tokenizer, prompt=args.prompt, num_tokens=args.bytes,
                           temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                           context=config.context,
                           positions=getattr(dataset, "boundaries", False))
        sys.stdout.write(text + "\n")
        pipe.close()
    finally:
        dist.destroy_process_group()
    return 0
