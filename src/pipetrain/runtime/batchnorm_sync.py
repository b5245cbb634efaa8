"""Deferred batch norm across data-parallel replicas: one commit over the whole mini-batch.

Each replica of a stage tracks the statistics of its own micro-batches
(:class:`~pipetrain.batchnorm.DeferredBatchNorm` with ``chunks`` = the micro-batches of
the whole mini-batch, so it never commits by itself). At the end of the step the
replicas exchange ``(count, mean, m2)`` per layer and merge them in replica order (Chan
et al.'s parallel update, in float64), so every replica commits the same running
statistics: those of the whole mini-batch, as single-process training stores them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipetrain.batchnorm import DeferredBatchNorm

__all__ = ["DeferredNorms", "merge_statistics"]

Statistics = tuple[int, int, Tensor, Tensor]
"""``(micro-batches, count, mean, m2)``, as :meth:`DeferredBatchNorm.tracked_statistics`."""


def merge_statistics(parts: Sequence[Statistics]) -> Statistics:
    """The statistics of the union of ``parts``, merged in order.

    Example:
        >>> x = torch.tensor([[1.0], [2.0], [4.0], [7.0]], dtype=torch.float64)
        >>> def stats(t):
        ...     return 1, t.shape[0], t.mean(0), ((t - t.mean(0)) ** 2).sum(0)
        >>> microbatches, count, mean, m2 = merge_statistics([stats(x[:1]), stats(x[1:])])
        >>> microbatches, count, mean.tolist(), m2.tolist() == stats(x)[3].tolist()
        (2, 4, [3.5], True)
    """
    microbatches, count = 0, 0
    mean = torch.zeros_like(parts[0][2], dtype=torch.float64)
    m2 = torch.zeros_like(mean)
    for part_microbatches, part_count, part_mean, part_m2 in parts:
        microbatches += part_microbatches
        if part_count == 0:
            continue
        total = count + part_count
        delta = part_mean.double() - mean
        mean = mean + delta * (part_count / total)
        m2 = m2 + part_m2.double() + delta.square() * (count * part_count / total)
        count = total
    return microbatches, count, mean, m2


class DeferredNorms:
    """The deferred batch norms of one rank's layers, committed once per step.

    Example:
        >>> layer = nn.Sequential(nn.Linear(2, 2), DeferredBatchNorm(2, chunks=2))
        >>> norms = DeferredNorms([layer], group=None, replicas=1)
        >>> _ = layer(torch.randn(4, 2))  # one micro-batch of two: not committed by itself
        >>> norms.commit()
        >>> int(layer[1].num_batches_tracked)
        1
    """

    def __init__(self, layers: Iterable[nn.Module], *, group: Any, replicas: int) -> None:
        seen: set[int] = set()
        self.norms: list[DeferredBatchNorm] = []
        for layer in layers:
            for module in layer.modules():
                if isinstance(module, DeferredBatchNorm) and id(module) not in seen:
                    seen.add(id(module))
                    self.norms.append(module)
        self.group = group
        self.replicas = replicas

    def commit(self) -> None:
        """Merge the replicas' tracked statistics (a collective over ``group`` when
        ``replicas > 1``) and commit them into the running statistics."""
        if self.replicas > 1 and self.norms:
            self._merge_replicas()
        for norm in self.norms:
            norm.commit()

    def _merge_replicas(self) -> None:
        device = self.norms[0].tracked_mean.device
        packed = []
        for norm in self.norms:
            microbatches, count, mean, m2 = norm.tracked_statistics()
            head = torch.tensor([microbatches, count], dtype=torch.float64, device=device)
            packed += [head, mean.double(), m2.double()]
        mine = torch.cat(packed)
        gathered = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(gathered, mine, group=self.group)
        offset = 0
        for norm in self.norms:
            size = norm.num_features
            parts = []
            for other in gathered:
                fields = other[offset:offset + 2 + 2 * size]
                parts.append((int(fields[0]), int(fields[1]), fields[2:2 + size],
                              fields[2 + size:]))
            offset += 2 + 2 * size
            microbatches, count, mean, m2 = merge_statistics(parts)
            norm.set_tracked_statistics(microbatches, count, mean, m2)
