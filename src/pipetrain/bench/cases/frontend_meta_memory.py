"""Case ``frontend_meta_memory``: a GPT-2 bigger than one process's memory cap trains over 4 processes that each stay under it.

The model (Hugging Face ``GPT2LMHeadModel``, byte vocabulary; full size 2.25 GiB of fp32
parameters: 48 blocks of width 1024) is built on the meta device in every process, so
building and capturing it allocates nothing. Each of the 4 pipeline ranks materializes
only its stage (a quarter of the blocks), trains 2 steps (1F1B, 4 micro-batches, SGD
without momentum) and reports its peak resident memory (``ru_maxrss``) after the first
step and after the last: from the second step on, the runtime's gradient pool keeps last
step's gradient buffers while autograd makes new ones for the weights it accumulates
itself (GPT-2's ``Conv1D``), one more copy of the stage's gradients at the peak. The cap
is the whole model's weights plus their gradients (2x its parameter bytes): the least
that training it in one process holds, before activations, optimizer state and the
interpreter; every peak is also compared with the weights alone. Two runs:

* ``init``: every rank initializes its stage with the model's own ``_init_weights``;
* ``safetensors``: every rank loads its stage from a sharded Hugging Face checkpoint
  (``model.safetensors.index.json``, one shard per block, written here shard by shard so
  that the writer never holds the model either), reading only its own tensors.

``--quick``: the ``safetensors`` run alone, of 4 blocks of width 128 (3 MiB of
parameters) over 2 ranks, where the interpreter and torch's own memory dominate every
rank's peak: it shows the mechanism, not the saving.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.drawings import bars, find_table, number
from pipetrain.launch import run_processes

__all__ = ["CASE", "Options", "draw", "run", "worker"]

_MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Options:
    """The GPT-2's shape, the batch and the steps."""

    layers: int = 48
    width: int = 1024
    batch: int = 4
    seq: int = 16
    steps: int = 2
    ranks: int = 4
    """Pipeline ranks (one stage each)."""
    runs: tuple[str, ...] = ("init", "safetensors")
    """How the ranks get their weights: ``init`` (their own), ``safetensors`` (loaded)."""


FULL = Options()
QUICK = replace(FULL, layers=4, width=128, ranks=2, runs=("safetensors",))


def _meta_model(args: Options) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=args.width, n_layer=args.layers,
                        n_head=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model: torch.nn.Module = GPT2LMHeadModel(config)
    return model


def _write_checkpoint(args: Options, folder: str) -> None:
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


def worker(ctx: Any, args: Options, weights: str | None) -> dict[str, Any]:
    """One rank: its stage materialized (initialized or loaded), trained; its peaks."""
    from pipetrain import Pipeline, PipelineConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # this spawned rank's own environment
    torch.set_num_threads(1)
    model = _meta_model(args)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    splits = [f"transformer.h.{j * args.layers // args.ranks}" for j in range(1, args.ranks)]
    pipe = Pipeline(model, example_inputs=(x,), split_points=splits, weights=weights,
                    loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
                    optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                    config=PipelineConfig(schedule="1f1b", num_stages=args.ranks, num_microbatches=4),
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


def _table(results: dict[str, Any], args: Options) -> Table:
    full, cap = results["model_parameter_bytes"], results["cap_bytes"]
    rows = []
    for name in args.runs:
        for rank, r in enumerate(results[name]):
            rows.append([name, rank, round(r["stage_parameter_bytes"] / _MIB),
                         round(r["peak_rss_first_step"] / _MIB), round(r["peak_rss"] / _MIB),
                         round(r["peak_rss"] / cap, 2), r["peak_rss"] < cap,
                         r["peak_rss_first_step"] < full])
    return Table(
        title=f"Meta-device GPT-2, {args.layers} blocks x {args.width} "
              f"({full / _MIB:.0f} MiB of fp32 parameters), over {args.ranks} processes: peak RSS per rank",
        columns=["weights", "rank", "stage parameters MiB", "peak RSS after step 1 MiB",
                 f"peak RSS after {args.steps} steps MiB", "peak / cap", "under the cap",
                 "step 1 under the weights alone"],
        rows=rows,
        anchor=f"the cap, {cap / _MIB:.0f} MiB: the whole model's weights and gradients, the "
               "least that training it in one process holds",
        notes="init: each rank initializes its stage with the model's own _init_weights; "
              "safetensors: each rank reads only its own tensors from a sharded checkpoint. "
              "A small model (quick sizes) is dominated by the interpreter's and torch's own "
              "memory: only the full size compares with the cap.",
        key="peaks")


def run(context: BenchContext) -> BenchResult:
    """Write the sharded checkpoint, then train both ways on 4 ranks; each rank's peaks."""
    args = QUICK if context.quick else FULL
    model = _meta_model(args)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = 2 * full  # the whole model's weights and gradients
    results: dict[str, Any] = {"model_parameter_bytes": full, "cap_bytes": cap,
                               "options": asdict(args)}
    folder = tempfile.mkdtemp(prefix="pipetrain-meta-")
    try:
        if "safetensors" in args.runs:
            context.progress(f"writing a sharded checkpoint of {full / _MIB:.0f} MiB")
            _write_checkpoint(args, folder)
        for name in args.runs:
            weights = folder if name == "safetensors" else None
            context.progress(f"{name}: {args.ranks} ranks, {args.steps} steps")
            ranks = run_processes(worker, args.ranks, args, weights, timeout=3000)
            results[name] = ranks
            results[f"{name}_under_cap"] = all(r["peak_rss"] < cap for r in ranks)
            results[f"{name}_first_step_under_weights"] = all(
                r["peak_rss_first_step"] < full for r in ranks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return BenchResult(tables=[_table(results, args)], data=results)


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """Each rank's peak RSS (after the first step and after the last) against the cap
    (the whole model's weights and gradients): one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['frontend_meta_memory_peaks.png']
    """
    table = find_table(tables, "peaks")
    if table is None:
        return []
    peaks = [c for c in table.columns if c.startswith("peak RSS after")]
    cap = number(data.get("cap_bytes"))
    ranks = len({row[1] for row in table.rows})
    return bars(out / "frontend_meta_memory_peaks.png", table, ["weights", "rank"],
                {name.removesuffix(" MiB"): name for name in peaks}, form="{}, rank {}",
                title=f"Meta-device GPT-2 over {ranks} processes: peak RSS per rank vs the "
                      "one-process cap", ylabel="MiB",
                reference=None if cap is None else cap / _MIB,
                reference_label=None if cap is None else f"cap, {cap / _MIB:.0f} MiB")


CASE = Case(name="frontend_meta_memory",
            title="A meta-device GPT-2 over 4 processes, each under the one-process cap",
            run=run, draw=draw, quick_seconds=25, full_seconds=250,
            needs=("transformers", "safetensors"))
