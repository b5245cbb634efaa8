"""A GPT-2 bigger than one process's memory cap trains over 4 processes that each stay under it.

The model (Hugging Face ``GPT2LMHeadModel``, byte vocabulary, default 2.25 GiB of fp32
parameters: 48 blocks of width 1024) is built on the meta device in every process, so
building and capturing it allocates nothing. Each of the 4 pipeline ranks materializes
only its stage (a quarter of the blocks), trains 2 steps (1F1B, 4 micro-batches, SGD
without momentum) and reports its peak resident memory (``ru_maxrss``) after the first
step and after the last: from the second step on, the runtime's gradient pool keeps last
step's gradient buffers while autograd makes new ones for the weights it accumulates
itself (GPT-2's ``Conv1D``), one more copy of the stage's gradients at the peak. The cap
is the whole model's weights plus their gradients (2x its parameter bytes): the least
that training it in one process holds, before activations, optimizer state and the
interpreter; the report also compares every peak with the weights alone. Two runs:

* ``init``: every rank initializes its stage with the model's own ``_init_weights``;
* ``safetensors``: every rank loads its stage from a sharded Hugging Face checkpoint
  (``model.safetensors.index.json``, one shard per block, written here shard by shard so
  that the writer never holds the model either), reading only its own tensors.

Figures on a shared machine are "under load". Usage::

    python benchmarks/frontend_meta_memory.py [--layers 32 --width 1024 --json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
from typing import Any

import torch
from torch.nn import functional as F

from pipetrain.launch import run_processes

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _meta_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=args.width, n_layer=args.layers,
                        n_head=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def _write_checkpoint(args: argparse.Namespace, folder: str) -> None:
    """A sharded checkpoint, one shard per top-level piece, never the whole model at once."""
    from safetensors.torch import save_file

    model = _meta_model(args)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:
            continue  # a tied weight is saved once, under its first name
        seen.add(id(tensor))
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[1:2] == ["h"] else parts[0]
        groups.setdefault(key, {})[name] = tensor
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for index, tensors in enumerate(groups.values()):
        real = {n: (torch.randn(t.shape, generator=generator) * 0.02 if n.endswith("weight")
                    else torch.zeros(t.shape)).contiguous() for n, t in tensors.items()}
        file = f"model-{index:05d}.safetensors"
        save_file(real, os.path.join(folder, file))
        weight_map.update({n: file for n in real})
        del real
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


def worker(ctx: Any, args: argparse.Namespace, weights: str | None) -> dict[str, Any]:
    from pipetrain import Pipeline, PipelineConfig

    torch.set_num_threads(1)
    model = _meta_model(args)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    splits = [f"transformer.h.{j * args.layers // 4}" for j in range(1, 4)]
    pipe = Pipeline(model, example_inputs=(x,), split_points=splits, weights=weights,
                    loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
                    optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                    config=PipelineConfig(schedule="1f1b", num_stages=4, num_microbatches=4),
                    context=ctx)
    losses = [pipe.train_step(x, y)]
    first_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses += [pipe.train_step(x, y) for _ in range(args.steps - 1)]
    held = sum(p.numel() * p.element_size() for p in pipe.parameters())
    read = len(pipe.captured.materializer.weights.read) if weights and pipe.captured else 0
    pipe.close()
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_first_step": first_peak,
            "stage_parameter_bytes": held, "losses": losses, "tensors_read": read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = _meta_model(args)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = 2 * full  # the whole model's weights and gradients
    results: dict[str, Any] = {"model_parameter_bytes": full, "cap_bytes": cap, "args": vars(args)}
    folder = tempfile.mkdtemp(prefix="pipetrain-meta-")
    try:
        _write_checkpoint(args, folder)
        for name, weights in (("init", None), ("safetensors", folder)):
            ranks = run_processes(worker, 4, args, weights, timeout=3000)
            results[name] = ranks
            results[f"{name}_under_cap"] = all(r["peak_rss"] < cap for r in ranks)
            results[f"{name}_first_step_under_weights"] = all(
                r["peak_rss_first_step"] < full for r in ranks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"GPT-2 {args.layers} x {args.width}: {full / 2**30:.2f} GiB of fp32 parameters; "
          f"per-process cap {cap / 2**30:.2f} GiB (weights + gradients; measured under load)")
    for name in ("init", "safetensors"):
        peaks = ", ".join(f"{r['peak_rss_first_step'] / 2**30:.2f} / {r['peak_rss'] / 2**30:.2f}"
                          for r in results[name])
        stages = ", ".join(f"{r['stage_parameter_bytes'] / 2**30:.2f}" for r in results[name])
        print(f"  {name:11s} peak RSS per rank, first step / all (GiB): {peaks}; stage parameters (GiB): "
              f"{stages}; all under the cap: {results[f'{name}_under_cap']}; first step under the "
              f"weights alone: {results[f'{name}_first_step_under_weights']}; losses rank 3: "
              f"{[round(v, 4) for v in results[name][3]['losses']]}")


if __name__ == "__main__":
    main()
