"""A step's batch cut for the pipeline: micro-batches of the whole batch, dealt to replicas.

Every rank passes the same global batch. It is split into ``num_microbatches``
near-equal micro-batches (:func:`~pipetrain.microbatch.split_batch`; views, no copies),
and micro-batch ``i`` of a stage runs on that stage's replica ``i % replicas`` (the
schedule says which rank runs what). Each micro-batch's loss is weighted by its share of
the batch (of its samples, or with ``per_token`` of its real tokens: integer targets other
than -100), so the mean loss and the gradients are those of the whole batch.

The first training batch sets the batch size and must fill every micro-batch (else the
step would quietly run fewer micro-batches than configured). A later, smaller batch — the
last of an epoch — runs as fewer micro-batches, with the same math, as long as every
replica still gets one. Evaluation takes a batch of any size: replicas left without a
micro-batch idle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipetrain.data.samples import real_tokens
from pipetrain.microbatch import batch_size, split_batch

__all__ = ["LOSS_WEIGHTS", "StepBatches", "StepSplitter"]

LOSS_WEIGHTS = ("sample", "token")
"""What a micro-batch's loss is weighed by: its share of the step's samples or real tokens."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBatches:
    """The micro-batches of a step (the whole batch's)."""

    inputs: list[Any]
    targets: list[Any]
    """Per micro-batch; ``None`` entries when the step has no targets."""
    scales: list[float]
    """Each micro-batch's share of the batch (its loss weight)."""


@dataclass
class StepSplitter:
    """Cuts global batches into ``num_microbatches`` micro-batches; ``min_microbatches``
    is how many a training step needs at least (one per replica of the most replicated
    stage).

    Example:
        >>> import torch
        >>> cut = StepSplitter(num_microbatches=4, min_microbatches=2)
        >>> step = cut.train(torch.zeros(8, 3), torch.zeros(8))
        >>> [tuple(x.shape) for x in step.inputs], step.scales
        ([(2, 3), (2, 3), (2, 3), (2, 3)], [0.25, 0.25, 0.25, 0.25])
        >>> StepSplitter(num_microbatches=4).train(torch.zeros(2, 3), torch.zeros(2))
        Traceback (most recent call last):
        ...
        ValueError: a batch of 2 samples cannot fill the step's 4 micro-batches (num_microbatches=4; ...
    """

    num_microbatches: int
    min_microbatches: int = 1
    first_replicas: int = 1
    """Replicas of the first stage: ``num_microbatches`` is the configured count per
    replica of it times this (for the messages)."""
    per_token: bool = False
    """Weigh each micro-batch by its share of the real tokens (targets that are not -100)."""
    batch_size: int | None = field(default=None, init=False)
    """Samples of the first training batch (None before it)."""

    def _check(self, total: int) -> None:
        wanted, replicas = self.num_microbatches, self.first_replicas
        if self.batch_size is None and total < wanted:
            configured = f"num_microbatches={wanted // replicas}"
            if replicas > 1:
                configured += f" x {replicas} replicas of the first stage"
            raise ValueError(
                f"a batch of {total} samples cannot fill the step's {wanted} micro-batches "
                f"({configured}; every micro-batch needs at least one sample, the step would "
                f"run {total}); fix: a batch of at least {wanted} samples, or "
                f"num_microbatches={max(total // replicas, 1)}"
            )
        if total < self.min_microbatches:
            raise ValueError(
                f"a training batch of {total} samples cannot give each of "
                f"{self.min_microbatches} replicas a micro-batch; fix: a batch of at least "
                f"{self.min_microbatches} samples"
            )
        if self.batch_size is None:
            self.batch_size = total
        elif total < self.batch_size:
            logger.info("a batch of %d samples (the first had %d) runs as fewer micro-batches",
                        total, self.batch_size)

    def _split(self, inputs: Any, targets: Any) -> StepBatches:
        total = batch_size(inputs)
        batches = split_batch(inputs, self.num_microbatches)
        scales = [batch_size(b) / total for b in batches]
        if targets is None:
            return StepBatches(batches, [None] * len(batches), scales)
        labels = split_batch(targets, self.num_microbatches)
        if len(labels) != len(batches):
            raise ValueError(
                f"inputs and targets split into {len(batches)} and {len(labels)} micro-batches: "
                "they must have the same batch size"
            )
        if self.per_token:
            scales = _token_shares(labels)
        return StepBatches(batches, labels, scales)

    def train(self, inputs: Any, targets: Any) -> StepBatches:
        """The micro-batches of a training step (checks the batch's size)."""
        self._check(batch_size(inputs))
        return self._split(inputs, targets)

    def eval(self, inputs: Any, targets: Any = None) -> StepBatches:
        """The micro-batches of an evaluation step (any batch size)."""
        return self._split(inputs, targets)


def _token_shares(labels: list[Any]) -> list[float]:
    """Each micro-batch's share of the step's real tokens (loss_per="token")."""
    counts = [real_tokens(label) for label in labels]
    total = sum(counts)
    if total == 0 or 0 in counts:
        raise ValueError(
            f"loss_per='token': micro-batches hold {counts} real tokens (targets other than "
            "-100); every micro-batch needs at least one (its mean loss is undefined "
            "otherwise); fix: fewer micro-batches or batches with fewer padded rows")
    return [count / total for count in counts]
