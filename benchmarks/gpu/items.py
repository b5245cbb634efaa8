"""The items of the GPU check, in the order they run, with their time budgets."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CPU_TOTAL_S", "CUDA_TOTAL_S", "ITEMS", "Item", "by_name"]


@dataclass(frozen=True, kw_only=True)
class Item:
    """One item: the module whose ``run(ctx)`` measures it, and its budgets (seconds)."""

    name: str
    module: str
    title: str
    cuda_s: float
    """Budget on one GPU (full sizes)."""
    cpu_s: float
    """Budget on the CPU with ``--quick`` (twice that without)."""


ITEMS = (
    Item(name="cuda_tests", module="gpu.cuda_tests", cuda_s=110, cpu_s=30,
         title="every test of tests/ that needs CUDA, run with pytest"),
    Item(name="gpipe_vs_torchgpipe", module="gpu.vs_torchgpipe", cuda_s=100, cpu_s=30,
         title="GPipe vs torchgpipe 0.0.7 on one device: throughput and peak memory"),
    Item(name="gpipe_streams", module="gpu.streams", cuda_s=30, cpu_s=5,
         title="GPipe's CUDA streams: do copies and compute of different micro-batches overlap"),
    Item(name="pipeline_one_process", module="gpu.one_process", cuda_s=60, cpu_s=30,
         title="Pipeline with several stages in one process (interleaved, ZB-V) vs plain "
               "PyTorch, fp32 / bf16 / fp16"),
    Item(name="max_model_size", module="gpu.max_model", cuda_s=70, cpu_s=40,
         title="GPipe's Table 1 on one device: the largest GPT under a memory cap, with and "
               "without re-materialization"),
    Item(name="planner", module="gpu.planner_item", cuda_s=45, cpu_s=20,
         title="the planner on a profile taken on the device: predicted vs measured step"),
    Item(name="nccl", module="gpu.nccl", cuda_s=10, cpu_s=10,
         title="multi-process Pipeline over NCCL"),
)

CUDA_TOTAL_S = 470.0
"""The whole run on a GPU stays under 8 minutes: items past this are skipped, saying so."""
CPU_TOTAL_S = 175.0
"""The whole ``--device cpu --quick`` run stays under 3 minutes."""


def by_name(name: str) -> Item:
    """The item called ``name``.

    Example:
        >>> by_name("nccl").module
        'gpu.nccl'
    """
    for item in ITEMS:
        if item.name == name:
            return item
    raise ValueError(f"no item {name!r}; the items are {', '.join(i.name for i in ITEMS)}")
