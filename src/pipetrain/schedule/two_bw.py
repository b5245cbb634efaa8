"""PipeDream-2BW: 1F1B without flushes, gradients accumulated per step, two weight versions."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.async_stream import AsyncStream
from pipetrain.schedule.program import Schedule

__all__ = ["two_bw"]


def two_bw(
    num_stages: int,
    num_microbatches: int,
    *,
    replicas: Sequence[int] | None = None,
    num_steps: int = 1,
) -> Schedule:
    """PipeDream-2BW (Narayanan et al., 2021): double-buffered weight updates.

    Micro-batches stream in 1F1B order without flushes; a stage accumulates the
    gradients of a step's ``M`` micro-batches and applies the update after the backward
    of the last one (``STEP``). Every micro-batch of step ``t``, on every stage, uses
    version ``max(t - 1, 0)``, so the update is ``W(t+1) = W(t) - lr * grad(W(t-1))``: a
    delay of exactly one step, whatever the number of stages (one included). A stage
    keeps two versions, the live one and the one the current step uses; that needs
    ``M >= K - 1`` (with replicas: ``M >= r_j * w_j`` on every stage; see
    :meth:`~.async_stream.AsyncStream.minimum_count`), as the paper's ``m >= d`` (its
    ``d`` counts the input stage's micro-batches in flight, here ``K - 1`` when the next
    step's first forward runs). ``num_steps`` steps of ``num_microbatches`` run, then the
    drain.

    Example (one column per clock tick, unit costs; three steps of three micro-batches:
    steps 0 and 1 use version 0, step 2 uses version 1):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(two_bw(3, 3, num_steps=3)))
        rank 0: F0v0 F1v0 F2v0 .    .    B0v0 F3v0 B1v0 F4v0 B2v0 F5v0 B3v0 F6v1 B4v0 F7v1 B5v0 F8v1 B6v1 .    B7v1 .    B8v1
        rank 1: .    F0v0 F1v0 .    B0v0 F2v0 B1v0 F3v0 B2v0 F4v0 B3v0 F5v0 B4v0 F6v1 B5v0 F7v1 B6v1 F8v1 B7v1 .    B8v1
        rank 2: .    .    F0v0 B0v0 F1v0 B1v0 F2v0 B2v0 F3v0 B3v0 F4v0 B4v0 F5v0 B5v0 F6v1 B6v1 F7v1 B7v1 F8v1 B8v1

    Raises:
        ValueError: a count below 1, or too few micro-batches per step for two versions.
    """
    check_counts({"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
                 context="2bw")
    if replicas is not None and len(replicas) != num_stages:
        raise ValueError(f"2bw: replicas {list(replicas)} has {len(replicas)} entries for "
                         f"{num_stages} stages; fix: one replica count per stage")
    stream = AsyncStream("2bw", [1] * num_stages if replicas is None else replicas)
    return stream.schedule(num_microbatches, num_steps=num_steps)
