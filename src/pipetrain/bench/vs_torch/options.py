"""The settings of the comparison with torch.distributed.pipelining: its three parts' sizes and repetitions."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.bench.vs_torch.runners import TORCH_VARIANTS

__all__ = ["SCHEDULES", "Options"]

SCHEDULES = tuple(TORCH_VARIANTS)
"""pipetrain's schedules compared with torch's, by the name used in the tables."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """Part 1 (the MLP, every schedule), part 2 (the default GPT against one process),
    part 3 (``tf_``: the compute-bound GPT against torch and one process).

    Example:
        >>> Options(depth=6)
        Traceback (most recent call last):
        ...
        ValueError: depth 6 must be a multiple of 4 (2 ranks x up to 2 stages)
    """

    reps: int = 25
    """Timed repetitions of part 1."""
    warmup: int = 5
    schedules: tuple[str, ...] = SCHEDULES
    width: int = 1024
    depth: int = 8
    batch: int = 64
    microbatches: int = 8
    gpt_reps: int = 25
    gpt_warmup: int = 5
    tf_blocks: int = 8
    tf_width: int = 256
    tf_heads: int = 8
    tf_seq: int = 128
    tf_batch: int = 32
    tf_microbatches: int = 8
    tf_balance: tuple[int, int] | None = None
    """Layers per stage (embedding, blocks, head); ``None``: the cut whose ideal 1F1B step
    is shortest."""
    tf_schedules: tuple[str, ...] = SCHEDULES
    tf_reps: int = 10
    tf_warmup: int = 2
    tf_cost_rounds: int = 2
    """Rounds of M micro-batches timed per layer for the ideal of part 3."""
    trace_torch: bool = True
    """Time each forward / backward call of torch's stages (~1 us per call)."""
    malloc_tuned: bool = True
    """Run the workers with glibc keeping the memory they free (both frameworks), as
    ``pipetrain train``'s CPU workers do (:mod:`pipetrain.runtime.host_memory`); off:
    glibc's defaults, where a step's activations page-fault in again on the next."""
    timeout: float = 1800.0
    torch_timeout: float = 120.0
    """Timeout of torch's process groups."""

    def __post_init__(self) -> None:
        problems = []
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown:
            problems.append(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
        unknown = [s for s in self.tf_schedules if s not in SCHEDULES]
        if unknown:
            problems.append(f"unknown tf_schedules {unknown}; choose from {', '.join(SCHEDULES)}")
        if self.batch % self.microbatches:
            problems.append(f"batch {self.batch} is not a multiple of microbatches "
                            f"{self.microbatches}")
        if self.tf_batch % self.tf_microbatches:
            problems.append(f"tf_batch {self.tf_batch} is not a multiple of tf_microbatches "
                            f"{self.tf_microbatches}")
        if self.tf_balance is not None and (
                len(self.tf_balance) != 2 or sum(self.tf_balance) != self.tf_blocks + 2
                or min(self.tf_balance) < 1):
            problems.append(f"tf_balance {self.tf_balance}: give 2 positive layer counts adding "
                            f"up to {self.tf_blocks + 2} (embedding, blocks, head), or None")
        if self.depth % 4:
            problems.append(f"depth {self.depth} must be a multiple of 4 (2 ranks x up to 2 "
                            "stages)")
        if problems:
            raise ValueError("; ".join(problems))
