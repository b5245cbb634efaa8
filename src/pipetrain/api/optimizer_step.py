"""What ``REDUCE`` and ``STEP`` do: gradient all-reduce, tied weights, clipping, optimizers.

``REDUCE(j)`` starts the all-reduce of stage ``j``'s gradients without waiting: over the
stage's data-parallel replica group for ordinary parameters, over the tie group (every
holder of the weight, in every replica) for tied ones, so tied copies get the sum of all
their gradients. The first ``STEP`` of a step finishes every reduction of the rank and
checks the step (:mod:`.grad_check`: the global gradient norm, each weight counted once
over all stages, and whether every loss was finite), clips by the global norm, then each
``STEP(j)`` steps stage ``j``'s optimizer and LR scheduler and zeroes its gradients. A
non-finite step applies no update on any stage (unless ``nonfinite='ignore'``).

With fp16's loss scaler (:class:`~pipetrain.runtime.precision.LossScaler`) the same
check decides the step: the gradients are unscaled when it is finite (the norm reported
and clipped is the unscaled one), the step is skipped on every stage when it is not
(whatever ``nonfinite`` says: an overflow is expected, not an error), and the scale is
updated the same way on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.api.grad_check import GradCheck, check_gradients, clip_local_gradients, squared_norm
from pipetrain.api.tensor_parallel import local_tensor
from pipetrain.runtime.precision import LossScaler

__all__ = ["OptimizerFactory", "SchedulerFactory", "StageOptimizers", "TiedParameter"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds one stage's optimizer from its parameters, e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""Builds one stage's LR scheduler from its optimizer."""


@dataclass(frozen=True)
class TiedParameter:
    """A local copy of a weight tied across ranks, and the group that sums its gradient."""

    param: nn.Parameter
    stage: int
    group: Any
    """Process group of every holder of the weight (all replicas)."""
    counts_in_norm: bool
    """Whether this copy counts in the global gradient norm (one copy per replica does)."""


@dataclass
class _Pending:
    works: list[Any] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)


class StageOptimizers:
    """The :class:`~pipetrain.runtime.executor.StepHooks` of a multi-process pipeline.

    Example (one process, no replicas, no ties)::

        opt = StageOptimizers({0: list(model.parameters())}, optimizer=torch.optim.SGD...)
    """

    def __init__(
        self,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        *,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        dp_group: Any = None,
        dp_size: int = 1,
        ties: Sequence[TiedParameter] = (),
        clip_grad_norm: float | None = None,
        nonfinite: str = "error",
        release: Callable[[int], None] | None = None,
        scaler: LossScaler | None = None,
        sharded: bool = False,
        tensor_parallel: int = 1,
    ) -> None:
        self.tensor_parallel = tensor_parallel
        """Tensor-parallel ranks of each position (gradients are DTensors or copies)."""
        self.sharded = sharded
        """Whether the parameters are FSDP2 shards over the replicas (``data_parallel=
        'fsdp'``): FSDP's own hooks reduce-scatter their gradients (no all-reduce here),
        tied copies sum their local shards, and the norm counts each shard once."""
        self.release = release
        """Called with a stage after its step to reset its gradients (default:
        ``zero_grad(set_to_none=True)``)."""
        self.stage_params = {j: list(ps) for j, ps in stage_params.items()}
        # a stage without trainable parameters (an activation, a reshape) has no optimizer
        self.optimizers = {j: optimizer(ps) for j, ps in self.stage_params.items() if ps}
        self.schedulers = (
            {j: scheduler(o) for j, o in self.optimizers.items()} if scheduler is not None else {}
        )
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.ties = list(ties)
        self._tied_ids = {id(t.param) for t in self.ties}
        self.clip_grad_norm = clip_grad_norm
        self.nonfinite = nonfinite
        """``error`` / ``skip``: a non-finite step applies no update; ``ignore``: it does."""
        self.check_group: Any = None
        """Process group of the step check (every rank of the job; None: the default group)."""
        self.last_check: GradCheck | None = None
        """The gradient check of the last step (None when neither clipping nor the
        non-finite guard needs one)."""
        self.scalar_device = torch.device("cpu")
        """Where scalars for collectives live (the GPU with NCCL)."""
        self.losses_finite: Callable[[], bool] = lambda: True
        """Whether the losses this rank computed in the current step are all finite (set
        by the pipeline for each step)."""
        self.loss_sum: Callable[[], torch.Tensor | float] = lambda: 0.0
        """The sum of the losses this rank computed in the current step (set by the
        pipeline for each step; added up over the job by the step check)."""
        self.scaler = scaler
        """fp16's dynamic loss scale (the gradients arrive multiplied by its scale)."""
        self.overflowed = False
        """Whether the last step was skipped for a gradient overflow under fp16 loss
        scaling (every loss finite)."""
        self._pending: dict[int, _Pending] = {}
        self._squares: dict[int, torch.Tensor] = {}
        """Per stage whose gradients were final at its ``REDUCE``, their squared norm."""
        seen: dict[int, int] = {}
        for ps in self.stage_params.values():
            for key in {id(p) for p in ps}:
                seen[key] = seen.get(key, 0) + 1
        self._alone = {j for j, ps in self.stage_params.items() if all(seen[id(p)] == 1 for p in ps)}
        """Stages that share no parameter with another stage of this rank."""
        self._flats: dict[int, torch.Tensor] = {}
        """Per replicated stage, the buffer its gradients are all-reduced in."""
        self._stepped = False
        self._apply = True

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None if unchecked)."""
        return None if self.last_check is None else self.last_check.grad_norm

    @property
    def learning_rate(self) -> float | None:
        """The learning rate of this rank's first optimizer's first parameter group (None
        when this rank holds no trainable parameter)."""
        for optimizer in self.optimizers.values():
            return float(optimizer.param_groups[0]["lr"])
        return None

    @property
    def skipped(self) -> bool:
        """Whether the last step's update was skipped because it was not finite."""
        return not self._apply

    def begin_step(self) -> None:
        """Reset the per-step state (call before running a step's actions)."""
        self._pending.clear()
        self._squares.clear()
        self._stepped = False
        self._apply = True
        self.overflowed = False
        self.last_check = None

    # -- REDUCE -------------------------------------------------------------------------
    def reduce(self, stage: int) -> None:
        pending = _Pending()
        if self.dp_size > 1 and not self.sharded:
            params = [p for p in self.stage_params[stage]
                      if p.grad is not None and id(p) not in self._tied_ids]
            if params:
                flat = self._flat_gradients(stage, params)
                pending.works.append(dist.all_reduce(flat, group=self.dp_group, async_op=True))
                pending.finish.append(functools.partial(_unflatten, flat, params))
        for tie in self.ties:
            if tie.stage != stage:
                continue
            if tie.param.grad is None:
                tie.param.grad = torch.zeros_like(tie.param)
            pending.works.append(dist.all_reduce(local_tensor(tie.param.grad), group=tie.group,
                                                 async_op=True))
        self._pending[stage] = pending
        if self._checks() and stage in self._alone and self.dp_size == 1 and not self.ties \
                and not self.sharded and self.tensor_parallel == 1:
            # the gradients are final: their norm now, off the step's critical path where
            # a bubble follows, and while they are still in cache
            self._squares[stage] = squared_norm(self.stage_params[stage], self.scalar_device)

    def _flat_gradients(self, stage: int, params: list[nn.Parameter]) -> torch.Tensor:
        """The stage's gradients in one tensor, for one all-reduce. The buffer is kept
        from step to step (a fresh one of tens of MB costs its page faults every step)."""
        grads = [local_tensor(p.grad).reshape(-1) for p in params]  # type: ignore[arg-type]
        total = sum(g.numel() for g in grads)
        buffer = self._flats.get(stage)
        if len({(g.dtype, g.device) for g in grads}) != 1 or stage in self._pending:
            return torch.cat(grads)  # mixed dtypes, or the last one still in flight
        if buffer is None or buffer.numel() != total or buffer.dtype != grads[0].dtype \
                or buffer.device != grads[0].device:
            buffer = self._flats[stage] = torch.empty(total, dtype=grads[0].dtype,
                                                      device=grads[0].device)
        return torch.cat(grads, out=buffer)

    def _finish_reductions(self) -> None:
        for stage in self.stage_params:
            if stage not in self._pending:
                self.reduce(stage)  # a schedule without REDUCE actions
        for stage in list(self._pending):
            self.finish_reduction(stage)

    def finish_reduction(self, stage: int) -> None:
        """Wait for the all-reduce :meth:`reduce` started for ``stage`` (if any) and put
        the summed gradients in place."""
        pending = self._pending.pop(stage, None)
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        for finish in pending.finish:
            finish()

    # -- STEP ---------------------------------------------------------------------------
    def _own_params(self) -> list[nn.Parameter]:
        """This rank's parameters, each weight counted once per replica."""
        tied_elsewhere = {id(t.param) for t in self.ties if not t.counts_in_norm}
        unique = {id(p): p for params in self.stage_params.values() for p in params}
        return [p for key, p in unique.items() if key not in tied_elsewhere]

    def _checks(self) -> bool:
        """Whether the step is checked (clipping, the non-finite guard or loss scaling)."""
        return self.clip_grad_norm is not None or self.nonfinite != "ignore" or self.scaler is not None

    def _check(self) -> None:
        if not self._checks():
            return
        counted = {id(p) for j in self._squares for p in self.stage_params[j]}
        known = sum(self._squares.values(), torch.zeros((), dtype=torch.float64, device=self.scalar_device))
        check = check_gradients([p for p in self._own_params() if id(p) not in counted],
                                loss_finite=self.losses_finite(), known_squares=known,
                                replicas=1 if self.sharded else self.dp_size,
                                device=self.scalar_device,
                                group=self.check_group, loss_sum=self.loss_sum(),
                                tensor_parallel=self.tensor_parallel)
        if self.scaler is not None:
            check = self._unscale(check, self.scaler)
        self.last_check = check
        if not check.finite and (self.nonfinite != "ignore" or self.scaler is not None):
            self._apply = False
            return
        if self.clip_grad_norm is not None:
            unique = {id(p): p for params in self.stage_params.values() for p in params}
            if self.sharded or self.tensor_parallel > 1:
                clip_local_gradients(list(unique.values()), self.clip_grad_norm, check.grad_norm)
                return
            torch.nn.utils.clip_grads_with_norm_(
                list(unique.values()), self.clip_grad_norm, torch.tensor(check.grad_norm)
            )

    def _unscale(self, check: GradCheck, scaler: LossScaler) -> GradCheck:
        """The check of the unscaled gradients: divides them by the scale when finite and
        updates the scale (the same decision on every rank)."""
        self.overflowed = check.loss_finite and not check.finite
        if check.finite:
            unique = {id(p): p for params in self.stage_params.values() for p in params}
            scaler.unscale_([p.grad for p in unique.values() if p.grad is not None])
        norm = check.grad_norm / scaler.scale
        scaler.update(finite=check.finite)
        return GradCheck(grad_norm=norm, loss_finite=check.loss_finite, loss_sum=check.loss_sum)

    def step(self, stage: int) -> None:
        if not self._stepped:
            self._stepped = True
            self._finish_reductions()
            self._check()
        if stage not in self.optimizers:
            return
        if self._apply:
            self.optimizers[stage].step()
        if stage in self.schedulers and (self._apply or self.nonfinite == "skip"):
            self.schedulers[stage].step()
        if self.release is not None:
            self.release(stage)
        else:
            self.optimizers[stage].zero_grad(set_to_none=True)


def _unflatten(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        assert p.grad is not None
        grad = local_tensor(p.grad)
        n = grad.numel()
        grad.copy_(flat[offset : offset + n].view_as(grad))
        offset += n
