"""Part 2, the default GPT of ``pipetrain train``: pipeline on 2 ranks vs one process.

GPTConfig(num_layers=4, width=64, num_heads=4, context=128), batch 32, AdamW lr 3e-3 with
betas (0.9, 0.95) and weight decay 0.1, gradient clipping at 1.0, 1F1B, 2 stages, 8
micro-batches, trained by pipetrain on 2 ranks x 1 thread and by plain PyTorch in ONE
process with 2 intra-op threads, as many as the pipeline has in all (rank 0; rank 1
idles), its gradients kept between steps, same batches, alternating step by step; the
speedup of the medians.
"""

from __future__ import annotations

from typing import Any

from pipetrain.bench.harness import (
    foreign_load,
    gather_objects,
    interleave,
    median,
    quartiles,
    step_times,
)
from pipetrain.bench.vs_torch.analysis import timeline_analysis
from pipetrain.bench.vs_torch.options import Options

__all__ = ["THREADS", "analyse_gpt", "gpt_worker"]

_CONFIG: dict[str, Any] = {"num_layers": 4, "width": 64, "num_heads": 4, "context": 128}
_BATCH = 32
THREADS = 2
"""Intra-op threads of the one-process baseline: the pipeline's 2 ranks x 1 thread."""


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


class _Pipeline:
    label = "pipeline"

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.records: list[Any] = []

    def step(self, x: Any, y: Any) -> float:
        return float(self.pipe.train_step(x, y))

    def after_timed_step(self) -> None:
        self.records.append((self.pipe.last_step_start, list(self.pipe.last_timeline)))


class _Single:
    """The whole model in this process (rank 0 only), with ``THREADS`` intra-op threads
    during its step."""

    label = "single"
    ranks = (0,)

    def __init__(self, config: Any) -> None:
        from pipetrain.models import build_gpt

        self.model = build_gpt(config, seed=0)
        self.optimizer = _adamw(self.model.parameters())

    def step(self, x: Any, y: Any) -> float:
        import torch

        from pipetrain.models import gpt_loss

        before = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            loss = gpt_loss(self.model(x), y)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        finally:
            torch.set_num_threads(before)
        return float(loss.item())


def gpt_worker(ctx: Any, opts: Options) -> dict[str, Any]:
    """Every rank: the pipeline and (rank 0) the single process, timed alternately."""
    import torch.distributed as dist

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.data import TextDataset, load_corpus
    from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss, gpt_ties

    rank = dist.get_rank()
    config = GPTConfig(**_CONFIG)
    dataset = TextDataset(load_corpus(max_bytes=2_000_000), context=config.context, seed=0)
    pipe = Pipeline(gpt_layer_factories(config, seed=0), loss_fn=gpt_loss, optimizer=_adamw,
                    ties=gpt_ties(config),
                    config=PipelineConfig(schedule="1f1b", num_stages=2, num_microbatches=8,
                                          clip_grad_norm=1.0),
                    context=ctx)
    pipeline = _Pipeline(pipe)
    single = _Single(config) if rank == 0 else None

    def batch(k: int) -> tuple[Any, Any]:
        return dataset.batch(k, _BATCH)

    losses: dict[str, list[float]] = {"pipeline": [], "single": []}
    for k in range(2):  # the first steps: the same losses? (part of the warm-up)
        losses["pipeline"].append(pipeline.step(*batch(k)))
        if single is not None:
            losses["single"].append(single.step(*batch(k)))
    runners: list[Any] = [pipeline, single if single is not None else _Absent()]
    samples, window = interleave(runners, lambda k: batch(k + 2), reps=opts.gpt_reps,
                                 warmup=max(0, opts.gpt_warmup - 2))
    schedule = pipe.schedule(8)
    pipe.close()
    gathered = gather_objects({"samples": samples, "records": pipeline.records,
                               "cpu_window": window})
    if rank != 0:
        return {}
    return {"gathered": gathered, "losses": losses, "schedule": schedule}


class _Absent:
    """The single-process runner as seen from a rank that does not run it."""

    label = "single"
    ranks = (0,)

    def step(self, x: Any, y: Any) -> None:  # never called on this rank
        raise AssertionError("the single-process step runs on rank 0 only")


def analyse_gpt(raw: dict[str, Any]) -> dict[str, Any]:
    """The speedup and where the pipeline's time goes (in the parent)."""
    gathered = raw["gathered"]
    samples = [g["samples"] for g in gathered]
    pipe_times = step_times(samples, "pipeline")
    single = step_times(samples, "single")
    analysis = timeline_analysis([g["records"] for g in gathered], raw["schedule"], pipe_times)
    losses = raw["losses"]
    busy = analysis["busy_s_per_rank"]
    return {
        "step_s": {"pipeline": pipe_times, "single": single},
        "pipeline_median_s": median(pipe_times),
        "pipeline_quartiles_s": quartiles(pipe_times),
        "single_median_s": median(single),
        "single_quartiles_s": quartiles(single),
        "speedup": median(single) / median(pipe_times),
        "single_threads": THREADS,
        "tokens_per_s_pipeline": _BATCH * _CONFIG["context"] / median(pipe_times),
        "tokens_per_s_single": _BATCH * _CONFIG["context"] / median(single),
        "first_losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["pipeline"], losses["single"])),
        "idle_rank_cpu_s_during_single": median([s.main_cpu_s + s.other_cpu_s
                                                 for s in samples[1]["single"]]),
        "main_thread_cpu_s_per_rank": [median([s.main_cpu_s for s in g["pipeline"]])
                                       for g in samples],
        "other_threads_cpu_s_per_rank": [median([s.other_cpu_s for s in g["pipeline"]])
                                         for g in samples],
        "reps": len(pipe_times),
        "load_during_timing": foreign_load([g["cpu_window"] for g in gathered]),
        # the pipeline's compute (both ranks' F + B + STEP) against the single process's
        # step: what micro-batching and the pipeline add to the work itself
        "pipeline_busy_sum_s": sum(busy),
        "compute_inflation": sum(busy) / median(single) - 1.0,
        # the speedup with the pipeline's own compute, were it free of bubbles and overhead
        "speedup_bound_balanced": median(single) / (sum(busy) / 2),
        "speedup_bound_busiest_rank": median(single) / max(busy),
        "pipetrain": analysis,
    }
