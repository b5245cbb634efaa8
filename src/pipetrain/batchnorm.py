"""Deferred batch norm: running statistics per mini-batch, not per micro-batch.

In training, each micro-batch is normalized with its own statistics (as in GPipe), but
``running_mean``, ``running_var`` and ``num_batches_tracked`` are updated once per
mini-batch, after its last micro-batch, with the statistics of the whole mini-batch:
exactly what ``nn.BatchNorm`` run on the full batch stores. Recomputation
(:func:`~pipetrain.checkpoint.is_recomputing`) is not tracked.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipetrain.checkpoint import is_recomputing
from pipetrain.counts import whole_number

__all__ = ["DeferredBatchNorm"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Accumulator buffers torchgpipe's DeferredBatchNorm persisted; ignored when loading.
_TORCHGPIPE_KEYS = ("sum", "sum_squares")


class DeferredBatchNorm(_BatchNorm):
    """A batch norm that updates its running statistics once per ``chunks`` micro-batches.

    Drop-in for ``torchgpipe.batchnorm.DeferredBatchNorm`` (same constructor and
    :meth:`convert_deferred_batch_norm`). Its ``state_dict`` holds the same keys as
    ``nn.BatchNorm*``: the per-mini-batch accumulators are not saved. Works on inputs
    of shape ``(N, C)`` or ``(N, C, *)``.

    If a step has fewer micro-batches than ``chunks`` (a batch smaller than
    ``chunks``), call :meth:`commit` after its last micro-batch.

    torchgpipe's attributes keep their names and meaning: ``chunks`` (an ``int``; a
    whole float is accepted), ``counter`` (values per channel tracked since the last
    update), ``tracked`` (micro-batches tracked since then), ``sum`` and
    ``sum_squares`` (their per-channel sums, read-only).

    Example:
        >>> import torch
        >>> bn = DeferredBatchNorm(3, chunks=2)
        >>> x = torch.randn(8, 3, 4, 4)
        >>> for chunk in x.chunk(2):
        ...     _ = bn(chunk)
        >>> ref = torch.nn.BatchNorm2d(3)
        >>> _ = ref(x)
        >>> torch.allclose(bn.running_var, ref.running_var, atol=1e-6)
        True
    """

    tracked_mean: Tensor
    tracked_m2: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        chunks: int = 1,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_chunks = whole_number(chunks)
        if num_chunks is None or num_chunks < 1:
            raise ValueError(
                f"chunks must be a positive integer (the number of micro-batches per "
                f"mini-batch), got {chunks!r}; fix: DeferredBatchNorm({num_features}, "
                f"chunks=4) for 4 micro-batches"
            )
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats=True,
            device=device, dtype=dtype,
        )
        self.chunks = num_chunks
        # Mean and sum of squared deviations of the micro-batches tracked so far.
        assert self.running_mean is not None  # track_running_stats=True
        self.register_buffer("tracked_mean", torch.zeros_like(self.running_mean), False)
        self.register_buffer("tracked_m2", torch.zeros_like(self.running_mean), False)
        self.counter = 0  # values per channel tracked so far (torchgpipe's name)
        self.tracked = 0  # micro-batches tracked so far (torchgpipe's name)

    @property
    def sum(self) -> Tensor:
        """Per-channel sum of the values tracked so far (torchgpipe's ``sum``), read-only.

        pipetrain keeps a running mean and sum of squared deviations instead (stable in
        low precision); this and :attr:`sum_squares` are computed from them.
        """
        return self.tracked_mean * self.counter

    @property
    def sum_squares(self) -> Tensor:
        """Per-channel sum of the squared values tracked so far (torchgpipe's), read-only."""
        return self.tracked_m2 + self.tracked_mean.square() * self.counter

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects an input of shape (N, C) or (N, C, *), got "
                f"shape {tuple(input.shape)}; fix: add the batch dimension, e.g. "
                f"input.unsqueeze(0)"
            )

    def _track(self, input: Tensor) -> None:
        """Fold one micro-batch's statistics in (Chan et al.'s parallel update)."""
        dims = [0, *range(2, input.dim())]
        count = input.numel() // input.size(1)
        with torch.no_grad():
            x = input.detach().to(self.tracked_mean.dtype)
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            total = self.counter + count
            delta = mean - self.tracked_mean
            self.tracked_mean += delta * (count / total)
            self.tracked_m2 += var * count + delta.square() * (self.counter * count / total)
        self.counter = total
        self.tracked += 1

    def commit(self) -> None:
        """Update the running statistics with the micro-batches tracked so far.

        Called automatically after ``chunks`` micro-batches; a no-op when nothing was
        tracked. Call it yourself after a step that had fewer micro-batches.

        Example:
            >>> import torch
            >>> bn = DeferredBatchNorm(2, chunks=4)
            >>> _ = bn(torch.randn(3, 2))  # only one micro-batch this step
            >>> int(bn.num_batches_tracked)
            0
            >>> bn.commit()
            >>> int(bn.num_batches_tracked)
            1
        """
        if self.tracked == 0:
            return
        count = self.counter
        with torch.no_grad():
            assert self.num_batches_tracked is not None  # always tracked
            self.num_batches_tracked += 1
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            unbiased_var = self.tracked_m2 / max(count - 1, 1)
            assert self.running_mean is not None and self.running_var is not None
            self.running_mean.lerp_(self.tracked_mean, factor)
            self.running_var.lerp_(unbiased_var, factor)
            self.tracked_mean.zero_()
            self.tracked_m2.zero_()
        self.counter = 0
        self.tracked = 0

    def tracked_statistics(self) -> tuple[int, int, Tensor, Tensor]:
        """``(micro-batches, count, mean, m2)`` tracked since the last commit: how many
        micro-batches and values per channel, their per-channel mean and sum of squared
        deviations (e.g. to merge those of data-parallel replicas before :meth:`commit`).

        Example:
            >>> bn = DeferredBatchNorm(2, chunks=4)
            >>> _ = bn(torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
            >>> microbatches, count, mean, m2 = bn.tracked_statistics()
            >>> microbatches, count, mean.tolist(), m2.tolist()
            (1, 2, [2.0, 0.0], [2.0, 0.0])
        """
        return self.tracked, self.counter, self.tracked_mean, self.tracked_m2

    def set_tracked_statistics(self, microbatches: int, count: int, mean: Tensor,
                               m2: Tensor) -> None:
        """Replace what is tracked (see :meth:`tracked_statistics`); :meth:`commit` then
        stores it in the running statistics.

        Example:
            >>> bn = DeferredBatchNorm(1, chunks=2, momentum=1.0)
            >>> bn.set_tracked_statistics(2, 4, torch.tensor([1.0]), torch.tensor([6.0]))
            >>> bn.commit()
            >>> bn.running_mean.tolist(), bn.running_var.tolist()
            ([1.0], [2.0])
        """
        with torch.no_grad():
            self.tracked_mean.copy_(mean)
            self.tracked_m2.copy_(m2)
        self.counter = count
        self.tracked = microbatches

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input``; in training, by its own statistics, tracking them."""
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias,
                training=False, momentum=0.0, eps=self.eps,
            )
        if not is_recomputing():
            self._track(input)
            if self.tracked >= self.chunks:
                self.commit()
        return F.batch_norm(
            input, None, None, self.weight, self.bias, training=True, momentum=0.0,
            eps=self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, chunks={self.chunks}"
        )

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        for key in _TORCHGPIPE_KEYS:  # saved by torchgpipe; we do not persist them
            state_dict.pop(prefix + key, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def convert_deferred_batch_norm(cls, module: ModuleT, chunks: int = 1) -> ModuleT:
        """Replace every tracking ``nn.BatchNorm*`` in ``module`` by a DeferredBatchNorm.

        The new layers share the old ones' parameters and running buffers (so an
        optimizer built before keeps working) and keep their device, dtype and
        training mode. Children are replaced in place; the converted module (the
        same object unless ``module`` itself is a batch norm) is returned.

        Example:
            >>> import torch
            >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
            >>> model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
            >>> type(model[1]).__name__, model[1].chunks
            ('DeferredBatchNorm', 4)
        """
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        converted: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            assert module.running_mean is not None
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine, chunks,
                device=module.running_mean.device, dtype=module.running_mean.dtype,
            )
            if module.affine:
                converted.register_parameter("weight", module.weight)
                converted.register_parameter("bias", module.bias)
            converted.register_buffer("running_mean", module.running_mean)
            converted.register_buffer("running_var", module.running_var)
            converted.register_buffer("num_batches_tracked", module.num_batches_tracked)
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return converted  # type: ignore[return-value]
