"""What ``REDUCE`` and ``STEP`` do under an asynchronous schedule: one stage's update.

A synchronous step updates every stage once, after a check over all of them (the global
gradient norm, the losses). An asynchronous schedule updates each stage on its own, at
its own time: ``REDUCE(j)`` starts the all-reduce of stage ``j``'s gradients over its
replicas (as :class:`~pipetrain.api.optimizer_step.StageOptimizers` does), and
``STEP(j)`` waits for it, applies the stage's optimizer through its weight versions
(:class:`~pipetrain.runtime.weight_versions.StageVersions`: a version still in use is
stashed first) and clears the gradients.

- ``pipedream``: one update per round of the stage's replicas (one micro-batch each), on
  the mean of their gradients (each micro-batch's loss is its own mean loss);
- ``2bw``: one update per training step, on the gradients accumulated over the step's
  micro-batches (each weighted by its share of the batch, as synchronous training).

The LR scheduler counts training steps: a stage steps it after the last update whose
gradients come from a training step's micro-batches, so every update of step ``t``
uses step ``t``'s learning rate, on every stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pipetrain.api.optimizer_step import StageOptimizers
from pipetrain.runtime.weight_versions import StageVersions

__all__ = ["AsyncUpdates"]


class AsyncUpdates:
    """The :class:`~pipetrain.runtime.executor.StepHooks` of an asynchronous pipeline.

    ``replicas`` is the number of replicas of this rank's stages; with ``average`` (PipeDream)
    an update applies the mean of their gradients.

    Example::

        updates = AsyncUpdates(pipe.optimizers, versions, replicas=1, average=True)
        updates.set_updates_per_step(8)   # PipeDream, 8 micro-batches per step
    """

    def __init__(self, optimizers: StageOptimizers, versions: Mapping[int, StageVersions], *,
                 replicas: int, average: bool) -> None:
        self.optimizers = optimizers
        self.versions = dict(versions)
        self.replicas = replicas
        self.average = average
        self.updates_per_step = 1
        """Updates a stage applies per training step (the LR scheduler steps after each
        such group)."""
        self._done: Counter[int] = Counter()

    def set_updates_per_step(self, count: int) -> None:
        """Start counting updates per training step anew (after a drain)."""
        self.updates_per_step = count
        self._done.clear()

    def reduce(self, stage: int) -> None:
        """Start the all-reduce of ``stage``'s gradients over its replicas."""
        self.optimizers.reduce(stage)

    def step(self, stage: int) -> None:
        """Apply ``stage``'s update and clear its gradients."""
        optimizers = self.optimizers
        optimizers.finish_reduction(stage)
        if self.average and self.replicas > 1:
            for param in optimizers.stage_params[stage]:
                if param.grad is not None:
                    param.grad.div_(self.replicas)
        optimizer = optimizers.optimizers.get(stage)
        self.versions[stage].update(optimizer.step if optimizer is not None else lambda: None)
        self._done[stage] += 1
        scheduler = optimizers.schedulers.get(stage)
        if scheduler is not None and self._done[stage] % self.updates_per_step == 0:
            scheduler.step()
        if optimizers.release is not None:
            optimizers.release(stage)
        elif optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
