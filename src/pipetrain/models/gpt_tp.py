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
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipetrain.models.gpt import Block, CausalSelfAttention, attend

__all__ = ["HeadsAttention", "gpt_tensor_parallel_plan"]


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
    parallelize_module(layer, mesh, {
        "attn.qkv": ColwiseParallel(use_local_output=False),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    })
