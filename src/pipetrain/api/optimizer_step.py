"""What ``REDUCE`` and ``STEP`` do: gradient all-reduce, tied weights, clipping, optimizers.

``REDUCE(j)`` starts the all-reduce of stage ``j``'s gradients without waiting: over the
stage's data-parallel replica group for ordinary parameters, over the tie group (every
holder of the weight, in every replica) for tied ones, so tied copies get the sum of all
their gradients. The first ``STEP`` of a step finishes every reduction of the rank, clips
by the global gradient norm (each weight counted once, over all stages), then each
``STEP(j)`` steps stage ``j``'s optimizer and LR scheduler and zeroes its gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
        pp_group: Any = None,  # the replica's pipeline ranks (None: the default group)
        ties: Sequence[TiedParameter] = (),
        clip_grad_norm: float | None = None,
        release: Callable[[int], None] | None = None,
    ) -> None:
        self.release = release
        """Called with a stage after its step to reset its gradients (default:
        ``zero_grad(set_to_none=True)``)."""
        self.stage_params = {j: list(ps) for j, ps in stage_params.items()}
        self.optimizers = {j: optimizer(ps) for j, ps in self.stage_params.items()}
        self.schedulers = (
            {j: scheduler(o) for j, o in self.optimizers.items()} if scheduler is not None else {}
        )
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.pp_group = pp_group
        self.ties = list(ties)
        self._tied_ids = {id(t.param) for t in self.ties}
        self.clip_grad_norm = clip_grad_norm
        self.last_grad_norm: float | None = None
        self.scalar_device = torch.device("cpu")
        """Where scalars for collectives live (the GPU with NCCL)."""
        self._pending: dict[int, _Pending] = {}
        self._stepped = False

    def begin_step(self) -> None:
        """Reset the per-step state (call before running a step's actions)."""
        self._pending.clear()
        self._stepped = False

    # -- REDUCE -------------------------------------------------------------------------
    def reduce(self, stage: int) -> None:
        pending = _Pending()
        if self.dp_size > 1:
            params = [p for p in self.stage_params[stage]
                      if p.grad is not None and id(p) not in self._tied_ids]
            if params:
                flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
                pending.works.append(dist.all_reduce(flat, group=self.dp_group, async_op=True))
                pending.finish.append(functools.partial(_unflatten, flat, params))
        for tie in self.ties:
            if tie.stage != stage:
                continue
            if tie.param.grad is None:
                tie.param.grad = torch.zeros_like(tie.param)
            pending.works.append(dist.all_reduce(tie.param.grad, group=tie.group, async_op=True))
        self._pending[stage] = pending

    def _finish_reductions(self) -> None:
        for stage in self.stage_params:
            if stage not in self._pending:
                self.reduce(stage)  # a schedule without REDUCE actions
        for pending in self._pending.values():
            for work in pending.works:
                work.wait()
            for finish in pending.finish:
                finish()
        self._pending.clear()

    # -- STEP ---------------------------------------------------------------------------
    def _clip(self) -> None:
        tied_elsewhere = {id(t.param) for t in self.ties if not t.counts_in_norm}
        seen: set[int] = set()
        total = torch.zeros((), dtype=torch.float64, device=self.scalar_device)
        for params in self.stage_params.values():
            for p in params:
                if p.grad is None or id(p) in seen or id(p) in tied_elsewhere:
                    continue
                seen.add(id(p))
                total += p.grad.detach().double().pow(2).sum().to(self.scalar_device)
        if dist.is_initialized() and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(total, group=self.pp_group)
        norm = math.sqrt(float(total))
        self.last_grad_norm = norm
        assert self.clip_grad_norm is not None
        coef = self.clip_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for params in self.stage_params.values():
                for p in {id(p): p for p in params}.values():
                    if p.grad is not None:
                        p.grad.mul_(coef)

    def step(self, stage: int) -> None:
        if not self._stepped:
            self._stepped = True
            self._finish_reductions()
            if self.clip_grad_norm is not None:
                self._clip()
        self.optimizers[stage].step()
        if stage in self.schedulers:
            self.schedulers[stage].step()
        if self.release is not None:
            self.release(stage)
        else:
            self.optimizers[stage].zero_grad(set_to_none=True)


def _unflatten(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        assert p.grad is not None
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
