"""A step's batch cut for the pipeline: this replica's share, split into micro-batches.

Every rank passes the same global batch. Replica ``d`` takes the ``d``-th of
``replicas`` near-equal shares (:func:`~pipetrain.microbatch.split_batch`), which it
splits into ``num_microbatches`` micro-batches; each micro-batch's loss is weighted by
its share of the global batch, so the mean loss and the gradients are those of the
whole batch.

The first training batch sets the batch size and must give every replica at least one
sample per micro-batch (else the step would quietly run fewer micro-batches than
configured). A later, smaller batch — the last of an epoch — runs as fewer
micro-batches, with the same math. Evaluation takes a batch of any size: replicas left
without a sample idle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipetrain.microbatch import batch_size, split_batch

__all__ = ["StepBatches", "StepSplitter"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBatches:
    """One replica's micro-batches of a step (empty when it has no sample)."""

    inputs: list[Any]
    targets: list[Any]
    """Per micro-batch; ``None`` entries when the step has no targets."""
    scales: list[float]
    """Each micro-batch's share of the global batch (its loss weight)."""


@dataclass
class StepSplitter:
    """Cuts global batches for one replica.

    Example:
        >>> import torch
        >>> cut = StepSplitter(replicas=2, replica=1, num_microbatches=2)
        >>> step = cut.train(torch.zeros(8, 3), torch.zeros(8))
        >>> [tuple(x.shape) for x in step.inputs], step.scales
        ([(2, 3), (2, 3)], [0.25, 0.25])
        >>> cut.train(torch.zeros(2, 3), torch.zeros(2))  # the first batch is too small
        Traceback (most recent call last):
        ...
        ValueError: a batch of 2 samples gives each replica 1, too few for num_microbatches=2 ...
    """

    replicas: int
    replica: int
    num_microbatches: int
    batch_size: int | None = field(default=None, init=False)
    """Samples of the first training batch (None before it)."""

    def _share(self, value: Any, *, training: bool) -> Any:
        if self.replicas == 1:
            return value
        shards = split_batch(value, self.replicas)
        if len(shards) <= self.replica:
            if not training:
                return None
            raise ValueError(
                f"a batch of {batch_size(value)} samples cannot feed {self.replicas} "
                "replicas; fix: use a batch of at least one sample per replica"
            )
        return shards[self.replica]

    def _check_first(self, total: int) -> None:
        if self.batch_size is not None:
            if total < self.batch_size:
                logger.info("a batch of %d samples (the first had %d) runs as fewer "
                            "micro-batches", total, self.batch_size)
            return
        per_replica = total // self.replicas
        wanted = self.num_microbatches
        if per_replica < wanted:
            across = f" ({wanted * self.replicas} for {self.replicas} replicas)" if self.replicas > 1 else ""
            raise ValueError(
                f"a batch of {total} samples gives each replica {per_replica}, too few for "
                f"num_microbatches={wanted} (every micro-batch needs at least one sample; "
                f"the step would run {max(per_replica, 1)}); fix: a batch of at least "
                f"{wanted} samples per replica{across}, or num_microbatches={max(per_replica, 1)}"
            )
        self.batch_size = total

    def _split(self, inputs: Any, targets: Any, *, training: bool) -> StepBatches:
        total = batch_size(inputs)
        shard = self._share(inputs, training=training)
        if shard is None:
            return StepBatches([], [], [])
        batches = split_batch(shard, self.num_microbatches)
        scales = [batch_size(b) / total for b in batches]
        if targets is None:
            return StepBatches(batches, [None] * len(batches), scales)
        labels = split_batch(self._share(targets, training=training), self.num_microbatches)
        if len(labels) != len(batches):
            raise ValueError(
                f"inputs and targets split into {len(batches)} and {len(labels)} micro-batches: "
                "they must have the same batch size"
            )
        return StepBatches(batches, labels, scales)

    def train(self, inputs: Any, targets: Any) -> StepBatches:
        """The micro-batches of a training step (checks the first batch's size)."""
        self._check_first(batch_size(inputs))
        return self._split(inputs, targets, training=True)

    def eval(self, inputs: Any, targets: Any = None) -> StepBatches:
        """The micro-batches of an evaluation step (any batch size)."""
        return self._split(inputs, targets, training=False)
