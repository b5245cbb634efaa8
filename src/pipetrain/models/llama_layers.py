"""A Hugging Face Llama as pipeline layers, and its tensor-parallel plan.

A captured model (``pipetrain.frontend``) runs graphs of ATen operations, which
``parallelize_module`` cannot split. For tensor parallelism, :func:`llama_layers` gives a
``LlamaForCausalLM``'s own modules as pipeline layers instead, each running Hugging
Face's code::

    layer 0          LlamaEmbedding  the token embedding
    layers 1 .. L    LlamaBlock      one LlamaDecoderLayer with the model's rotary embedding
    layer L + 1      LlamaHead       the final norm and the output projection

and :func:`llama_tensor_parallel_plan` splits each block as torchtitan and Megatron-LM
do: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` column-wise (each
rank computes its heads and its part of the MLP), ``o_proj`` and ``down_proj`` row-wise
(their outputs summed). The embedding and the head stay whole on every ``tp`` rank. The
parameters keep their shapes and Hugging Face's names below each layer
(``layer.self_attn.q_proj.weight`` in a block).

Limits: causal attention without padding (no attention mask; every sequence of a batch
has the same length), no key-value cache, untied embeddings, no attention dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["LlamaBlock", "LlamaEmbedding", "LlamaHead", "llama_layers",
           "llama_tensor_parallel_plan"]


class LlamaEmbedding(nn.Module):
    """The model's token embedding: token ids ``(B, T)`` -> hidden states ``(B, T, C)``.

    Example:
        >>> LlamaEmbedding(nn.Embedding(10, 4))(torch.zeros(2, 3, dtype=torch.long)).shape
        torch.Size([2, 3, 4])
    """

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.embed_tokens(input_ids)
        return out


class LlamaBlock(nn.Module):
    """One ``LlamaDecoderLayer``, given the rotary embedding of positions ``0 .. T-1``
    (computed here from the model's ``LlamaRotaryEmbedding``, as the model computes it
    once for all its layers).

    Example::

        inner = model.model  # a LlamaForCausalLM's decoder
        block = LlamaBlock(inner.layers[0], inner.rotary_emb)
        block(hidden).shape  # (B, T, C), as hidden
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb

    def forward(self, hidden: Tensor) -> Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out = self.layer(hidden, position_embeddings=self.rotary_emb(hidden, positions))
        result: Tensor = out[0] if isinstance(out, tuple) else out
        return result


class LlamaHead(nn.Module):
    """The final norm and the output projection: hidden states -> logits ``(B, T, V)``.

    Example:
        >>> head = LlamaHead(nn.Identity(), nn.Linear(4, 10, bias=False))
        >>> head(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 3, 10])
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.norm(hidden))
        return out


def llama_layers(model: nn.Module) -> list[Callable[[], nn.Module]]:
    """A ``LlamaForCausalLM``'s modules as pipeline layer factories (embedding, one per
    decoder layer, head; see the module docstring). Each factory returns the model's own
    modules, so the pipeline trains the model's weights.

    Raises:
        ValueError: ``model`` is not a Llama causal language model, or ties its input and
            output embeddings.

    Example::

        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False))
        pipe = Pipeline(llama_layers(model), loss_fn=..., optimizer=..., config=PipelineConfig(
            num_stages=2, tensor_parallel=2), tensor_parallel_plan=llama_tensor_parallel_plan)
    """
    inner: Any = getattr(model, "model", None)
    head: Any = getattr(model, "lm_head", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm",
                                                            "rotary_emb")) \
            or not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} is not a Llama causal language model (a "
                         "LlamaForCausalLM: model.embed_tokens, model.layers, model.norm, "
                         "model.rotary_emb, lm_head); fix: pass one, or capture the model "
                         "with pipetrain's frontend (no tensor parallelism)")
    if head.weight is inner.embed_tokens.weight:
        raise ValueError("the model ties its input and output embeddings "
                         "(tie_word_embeddings=True), which llama_layers does not split "
                         "across stages; fix: LlamaConfig(tie_word_embeddings=False)")
    factories: list[Callable[[], nn.Module]] = [lambda: LlamaEmbedding(inner.embed_tokens)]
    factories += [_block(layer, inner.rotary_emb) for layer in inner.layers]
    factories.append(lambda: LlamaHead(inner.norm, head))
    return factories


def _block(layer: nn.Module, rotary: nn.Module) -> Callable[[], nn.Module]:
    return lambda: LlamaBlock(layer, rotary)


def llama_tensor_parallel_plan(index: int, layer: nn.Module, mesh: DeviceMesh) -> None:
    """Split a :class:`LlamaBlock` over ``mesh`` (the ``tp`` sub-mesh) as the module
    docstring shows; the embedding and the head are left whole. A
    :data:`~pipetrain.api.tensor_parallel.TensorParallelPlan`.

    Raises:
        ValueError: the query or key-value heads or the MLP width do not divide among the
            ranks, or the attention has dropout.

    Example (in each process of a job with ``tensor_parallel=2``)::

        Pipeline(llama_layers(model), ..., config=PipelineConfig(num_stages=2,
                 tensor_parallel=2), tensor_parallel_plan=llama_tensor_parallel_plan)
    """
    if not isinstance(layer, LlamaBlock):
        return
    attention: Any = layer.layer.self_attn
    config = attention.config
    parts = mesh.size()
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    bad = {k: v for k, v in sizes.items() if v % parts}
    if bad:
        raise ValueError(f"the Llama's {bad} must divide among {parts} tensor-parallel ranks; "
                         "fix: a tensor-parallel size that divides the heads, the key-value "
                         "heads and the MLP width")
    if config.attention_dropout:
        raise ValueError(f"the Llama's attention dropout ({config.attention_dropout}) would "
                         "draw other masks on a tensor-parallel rank's heads than one process "
                         "draws; fix: attention_dropout=0.0, or tensor_parallel=1")
    parallelize_module(layer.layer, mesh, {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    })
