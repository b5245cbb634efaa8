"""PipeDream (1F1B without flushes, weight stashing, optional vertical sync)."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.async_stream import AsyncStream
from pipetrain.schedule.program import Schedule

__all__ = ["pipedream"]


def pipedream(
    num_stages: int,
    num_microbatches: int,
    *,
    vertical_sync: bool = False,
    replicas: Sequence[int] | None = None,
    num_steps: int = 1,
) -> Schedule:
    """PipeDream (Narayanan et al., 2019): asynchronous 1F1B with weight stashing.

    The input stage admits NOAM = ``ceil(workers / r_0)`` micro-batches (``K`` with one
    rank per stage), then every stage alternates one forward and one backward, and
    applies its optimizer update after each backward: one micro-batch, one update
    (``STEP`` produces the next version). A forward uses the stage's newest weights, so
    micro-batch ``i`` on stage ``j`` uses version ``max(0, i - K + j + 1)`` (the paper's
    ``w_j^(t-n+j)``, 1-based); its backward uses the same, stashed, weights. Stage ``j``
    keeps ``K - j`` versions (one per micro-batch in flight on it). With
    ``vertical_sync`` every stage uses the input stage's version of the micro-batch,
    ``max(0, i - K + 1)``, and keeps ``K`` versions. The run ends with a drain (the
    backwards of the micro-batches in flight); ``num_steps`` windows of
    ``num_microbatches`` precede it (one training step each, see :mod:`.async_stream`).

    ``replicas[j]`` ranks hold stage ``j`` (1F1B-RR: micro-batch ``i`` on replica
    ``i % r_j``); they update together, one ``REDUCE`` and ``STEP`` per round of ``r_j``
    micro-batches (the count must be a multiple of every ``r_j``).

    Example (one column per clock tick, unit costs; ``F3v1``: forward of micro-batch 3
    with weight version 1):
        >>> from pipetrain.schedule.grid import render_grid
        >>> print(render_grid(pipedream(3, 6)))
        rank 0: F0v0 F1v0 F2v0 .    .    B0v0 F3v1 B1v0 F4v2 B2v0 F5v3 B3v1 .    B4v2 .    B5v3
        rank 1: .    F0v0 F1v0 .    B0v0 F2v1 B1v0 F3v2 B2v1 F4v3 B3v2 F5v4 B4v3 .    B5v4
        rank 2: .    .    F0v0 B0v0 F1v1 B1v1 F2v2 B2v2 F3v3 B3v3 F4v4 B4v4 F5v5 B5v5
        >>> print(render_grid(pipedream(3, 6, vertical_sync=True)))
        rank 0: F0v0 F1v0 F2v0 .    .    B0v0 F3v1 B1v0 F4v2 B2v0 F5v3 B3v1 .    B4v2 .    B5v3
        rank 1: .    F0v0 F1v0 .    B0v0 F2v0 B1v0 F3v1 B2v0 F4v2 B3v1 F5v3 B4v2 .    B5v3
        rank 2: .    .    F0v0 B0v0 F1v0 B1v0 F2v0 B2v0 F3v1 B3v1 F4v2 B4v2 F5v3 B5v3

    Raises:
        ValueError: a count below 1, replica counts that do not divide
            ``num_microbatches``, or vertical sync with replica counts that differ.
    """
    check_counts({"num_stages": (num_stages, 1), "num_microbatches": (num_microbatches, 1)},
                 context="pipedream")
    if replicas is not None and len(replicas) != num_stages:
        raise ValueError(f"pipedream: replicas {list(replicas)} has {len(replicas)} entries for "
                         f"{num_stages} stages; fix: one replica count per stage")
    stream = AsyncStream("pipedream", [1] * num_stages if replicas is None else replicas,
                         vertical_sync=vertical_sync)
    return stream.schedule(num_microbatches, num_steps=num_steps)
