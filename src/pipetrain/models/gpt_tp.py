"""A tensor-parallel plan for pipetrain's GPT: each block's heads and MLP split over ``tp``.

Within a :class:`~pipetrain.models.gpt.Block` (the embedding and the head stay whole on
every ``tp`` rank)::

    attn.qkv   column-wise   C -> 3C, weight rows split; its output gathered whole
    attention  this rank's H / T heads of q, k and v                (B, H/T, T, D)
    attn.proj  row-wise      its input columns are this rank's heads; output summed
    mlp.fc     column-wise   C -> 4C / T
    mlp.proj   row-wise      4C / T -> C; output summed

``attn.qkv`` is one linear layer for q, k and v, so a column-wise split of its weight
gives rank ``t`` rows of q, k and v that are not its heads: its output is all-gathered
(one all-gather of ``(B, T, 3C)`` per block, and a reduce-scatter of its gradient, that a
model with separate q, k and v projections would not need), and each rank takes its
heads from it. The parameters keep
their names and shapes, so checkpoints move between tensor-parallel and whole runs.
Attention dropout would draw other masks than one process: the plan refuses it.

:func:`gpt_sequence_parallel_plan` adds sequence parallelism (Korthikanti et al., 2022)
inside each block: the block takes its whole input, keeps this rank's ``T / tp``
positions of it (a slice, no message), runs both LayerNorms and both residual adds on
those positions only (torch's ``SequenceParallel`` style: the norms' weight gradients
are summed over ``tp``), gathers the positions before ``attn.qkv`` and ``mlp.fc``,
reduce-scatters after ``attn.proj`` and ``mlp.proj`` (in place of their all-reduces), and
gathers its output whole again. The norms' saved inputs shrink by ``tp``; the gathered
inputs of ``attn.qkv`` and ``mlp.fc`` are kept whole for their weight gradients (not
gathered again in the backward, as Megatron-LM does); a block's messages are one
all-gather more than without it. Any sequence length (uneven shards too); no dropout
(each rank would draw its positions' masks, not one process's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipetrain.models.gpt import Block, CausalSelfAttention, _split_packed, attend

__all__ = ["HeadsAttention", "gpt_plan", "gpt_sequence_parallel_plan", "gpt_tensor_parallel_plan"]


class HeadsAttention(nn.Module):
    """:class:`~pipetrain.models.gpt.CausalSelfAttention` computing heads
    ``[index * H/T, (index + 1) * H/T)`` only, from its q, k and v whole; the same
    submodules (``qkv``, ``proj``, ``residual_dropout``), so the same parameter names.

    Example:
        >>> import torch
        >>> from pipetrain.models.gpt import GPTConfig
        >>> attention = CausalSelfAttention(GPTConfig(width=8, num_heads=2))
        >>> halves = [HeadsAttention(attention, index=i, num_parts=2) for i in (0, 1)]
        >>> halves[0].forward_heads(torch.zeros(1, 3, 8)).shape
        torch.Size([1, 3, 4])
    """

    def __init__(self, attention: CausalSelfAttention, *, index: int, num_parts: int) -> None:
        super().__init__()
        self.num_heads = attention.num_heads
        self.dropout = attention.dropout
        self.qkv = attention.qkv
        self.proj = attention.proj
        self.residual_dropout = attention.residual_dropout
        self.index = index
        self.num_parts = num_parts

    def forward_heads(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """This rank's heads' attention output ``(B, T, C / parts)``, before ``proj``."""
        B, T, C = x.shape
        H, D = self.num_heads // self.num_parts, C // self.num_heads  # heads here, head width
        mine = slice(self.index * H * D, (self.index + 1) * H * D)
        qkv = self.qkv(x)  # (B, T, 3C), a DTensor split over tp on its last dimension
        if isinstance(qkv, DTensor):
            # gathered whole; each rank's gradient of it covers its own heads: they add up
            qkv = qkv.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        q, k, v = (t[..., mine] for t in qkv.split(C, dim=2))  # 3 x (B, T, H*D)
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        y = attend(q, k, v, mask, 0.0)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        out: Tensor = self.residual_dropout(self.proj(self.forward_heads(x, mask)))  # (B, T, C)
        return out


def gpt_tensor_parallel_plan(index: int, layer: nn.Module, mesh: DeviceMesh) -> None:
    """Split a GPT block over ``mesh`` (the ``tp`` sub-mesh) as the module docstring
    shows; the embedding and the head are left whole. A
    :data:`~pipetrain.api.tensor_parallel.TensorParallelPlan`.

    Raises:
        ValueError: the heads or the width do not divide among the ranks, or the block
            has attention dropout.

    Example (in each process of a job with ``tensor_parallel=2``)::

        Pipeline(gpt_layer_factories(config, seed=0), ..., config=PipelineConfig(
            num_stages=2, tensor_parallel=2), tensor_parallel_plan=gpt_tensor_parallel_plan)
    """
    if not isinstance(layer, Block):
        return
    _split_heads(layer, mesh)
    parallelize_module(layer, mesh, {
        "attn.qkv": ColwiseParallel(use_local_output=False),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    })


def gpt_sequence_parallel_plan(index: int, layer: nn.Module, mesh: DeviceMesh) -> None:
    """:func:`gpt_tensor_parallel_plan` with sequence parallelism inside each block (see
    the module docstring); the embedding and the head are left whole. A
    :data:`~pipetrain.api.tensor_parallel.TensorParallelPlan`.

    Raises:
        ValueError: as :func:`gpt_tensor_parallel_plan`, or the block has dropout.

    Example (in each process of a job with ``tensor_parallel=2``)::

        Pipeline(gpt_layer_factories(config, seed=0), ..., config=PipelineConfig(
            num_stages=2, tensor_parallel=2), tensor_parallel_plan=gpt_sequence_parallel_plan)
    """
    if not isinstance(layer, Block):
        return
    dropouts = [m.p for m in layer.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropouts:
        raise ValueError(f"sequence parallelism with dropout {dropouts[0]}: each tensor-parallel "
                         "rank would draw the masks of its own positions, not one process's; "
                         "fix: dropout 0.0, or the plan without sequence parallelism")
    _split_heads(layer, mesh)
    positions = Shard(1)
    parallelize_module(layer, mesh, {
        "ln_1": SequenceParallel(),
        "attn.qkv": ColwiseParallel(input_layouts=positions, use_local_output=False),
        "attn.proj": RowwiseParallel(output_layouts=positions, use_local_output=False),
        "ln_2": SequenceParallel(),
        "mlp.fc": ColwiseParallel(input_layouts=positions),
        "mlp.proj": RowwiseParallel(output_layouts=positions, use_local_output=False),
    })

    def take_positions(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        h, where = _split_packed(args[0])
        shards = DTensor.from_local(h, mesh, (Replicate(),), run_check=False).redistribute(
            mesh, (positions,))  # this rank's positions: a slice; its gradient gathered
        return (shards if where is None else (shards, where), *args[1:])

    def gather_positions(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        h, where = _split_packed(output)
        assert isinstance(h, DTensor)
        whole = h.redistribute(mesh, (Replicate(),)).to_local()
        return whole if where is None else (whole, where)

    layer.register_forward_pre_hook(take_positions)
    layer.register_forward_hook(gather_positions)


def gpt_plan(sequence_parallel: bool = False) -> Callable[[int, nn.Module, DeviceMesh], None]:
    """The GPT's plan: :func:`gpt_sequence_parallel_plan` or :func:`gpt_tensor_parallel_plan`.

    Example:
        >>> gpt_plan(sequence_parallel=True).__name__
        'gpt_sequence_parallel_plan'
    """
    return gpt_sequence_parallel_plan if sequence_parallel else gpt_tensor_parallel_plan


def _split_heads(layer: Block, mesh: DeviceMesh) -> None:
    """Check that ``layer``'s heads and width divide among ``mesh``'s ranks and give its
    attention this rank's heads (:class:`HeadsAttention`)."""
    attention = layer.attn
    assert isinstance(attention, CausalSelfAttention)
    parts = mesh.size()
    width = attention.qkv.in_features
    if attention.num_heads % parts or width % parts:
        raise ValueError(f"the GPT's {attention.num_heads} heads and width {width} must divide "
                         f"among {parts} tensor-parallel ranks; fix: a tensor-parallel size "
                         f"that divides both, or heads and width that it divides")
    if attention.dropout > 0:
        raise ValueError(f"the GPT's attention dropout ({attention.dropout}) would draw other "
                         "masks on a tensor-parallel rank's heads than one process draws; "
                         "fix: dropout 0.0 with tensor parallelism, or tensor_parallel=1")
    layer.register_module("attn", HeadsAttention(attention, index=mesh.get_local_rank(),
                                                 num_parts=parts))
