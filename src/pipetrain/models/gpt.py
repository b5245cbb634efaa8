"""GPT: a decoder-only transformer language model, written as a sequence of layers.

nanoGPT's architecture (pre-LayerNorm blocks, causal self-attention, GELU MLP, learned
position embeddings, weights tied between the token embedding and the output
projection), cut into layers a pipeline can split::

    index 0           Embedding   int64 (B, T)  -> float (B, T, C)
    index 1 .. L      Block       (B, T, C)     -> (B, T, C)
    index L + 1       Head        (B, T, C)     -> logits (B, T, V)

``B`` batch, ``T`` tokens (any length up to ``context``), ``C`` width, ``V`` vocabulary,
``L`` ``num_layers``, ``H`` heads, ``D = C / H`` head width.

Packed documents: given ``{"input_ids": (B, T), "position_ids": (B, T)}`` (what
:class:`~pipetrain.data.SampleDataset` gives with ``boundaries=True``), the embedding
takes each token's position within its document, and every layer passes the positions on
beside its activation (a pair ``((B, T, C), (B, T))``), so that a token attends only to
the tokens of its own document before it (:func:`document_mask`; a document starts where
a position is not its predecessor's plus one, Hugging Face's convention). Each document
then gives the logits it gives alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipetrain.models.factory import (
    LayerFactory,
    Tie,
    build_sequential,
    count_parameters,
    derive_seed,
    seeded,
)

__all__ = [
    "Block",
    "Embedding",
    "GPTConfig",
    "Head",
    "attend",
    "build_gpt",
    "count_parameters",
    "document_mask",
    "generate",
    "gpt_layer",
    "gpt_layer_factories",
    "gpt_loss",
    "gpt_ties",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a GPT. The defaults make a byte-level model of ~0.8 M parameters.

    Example:
        >>> GPTConfig(num_layers=2, width=64)
        GPTConfig(vocab_size=256, context=128, num_layers=2, width=64, num_heads=4, dropout=0.0, tie_embeddings=True)
    """

    vocab_size: int = 256
    context: int = 128
    num_layers: int = 4
    width: int = 128
    num_heads: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        problems = []
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        for name in ("vocab_size", "context", "num_layers", "width", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(
                    f"{name}={value!r} must be a positive int, e.g. {name}={defaults[name]}"
                )
        if not problems and self.width % self.num_heads:
            fitting = max(h for h in range(1, self.num_heads + 1) if self.width % h == 0)
            rounded = math.ceil(self.width / self.num_heads) * self.num_heads
            problems.append(
                f"width={self.width} is not divisible by num_heads={self.num_heads}: "
                f"use num_heads={fitting} or width={rounded}"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} must be in [0, 1), e.g. dropout=0.1")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def parameters(self) -> int:
        """The number of parameters of :func:`build_gpt` of this shape (tied weights once),
        without building it: embeddings, blocks (two norms, q/k/v, output, MLP up and
        down, with biases) and the head's norm and projection.

        Example:
            >>> GPTConfig(num_layers=1, width=16, num_heads=2).parameters
            9456
        """
        width, vocab = self.width, self.vocab_size
        block = 12 * width * width + 13 * width
        head = 2 * width + (0 if self.tie_embeddings else vocab * width)
        return (vocab + self.context) * width + self.num_layers * block + head


def document_mask(position_ids: Tensor) -> Tensor:
    """The attention mask of packed documents: ``(B, 1, T, T)``, true where query ``q`` may
    see key ``k`` (``k <= q``, both in one document). A document starts at every position
    that is not its predecessor's plus one (and at each row's start).

    Example:
        >>> document_mask(torch.tensor([[0, 1, 0, 1, 2]]))[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = starts.cumsum(dim=1)  # (B, T): which document of the row
    T = position_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal).unsqueeze(1)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """Causal attention of ``(B, H, T, D)`` heads; within documents given ``mask``
    (:func:`document_mask`).

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> alone = attend(q[..., 2:, :], q[..., 2:, :], q[..., 2:, :], None, 0.0)
        >>> packed = attend(q, q, q, document_mask(torch.tensor([[0, 1, 0]])), 0.0)
        >>> torch.allclose(packed[..., 2:, :], alone)
        True
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def _split_packed(x: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """A layer's input: the activation, and the positions of packed documents (or None)."""
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return x, None


class Embedding(nn.Module):
    """Layer 0: token plus learned position embedding, int64 (B, T) -> float (B, T, C);
    ``{"input_ids", "position_ids"}`` of packed documents -> ``((B, T, C), position_ids)``
    (see the module docstring).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.context = config.context
        self.token = nn.Embedding(config.vocab_size, config.width)  # (V, C)
        self.position = nn.Embedding(config.context, config.width)  # (context, C)
        self.dropout = nn.Dropout(config.dropout)
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: Tensor | dict[str, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        if isinstance(tokens, dict):
            return self._packed(tokens)
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise TypeError(
                f"GPT input must be integer token ids of shape (batch, tokens), got a "
                f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}: pass e.g. "
                "ByteTokenizer().encode(text).unsqueeze(0)"
            )
        T = tokens.size(1)
        if T > self.context:
            raise ValueError(
                f"GPT input has {T} tokens but the model's context is {self.context}: "
                f"crop it to the last {self.context} (tokens[:, -{self.context}:]) "
                f"or build the model with GPTConfig(context={T})"
            )
        position = torch.arange(T, device=tokens.device)  # (T,)
        x: Tensor = self.token(tokens) + self.position(position)  # (B, T, C)
        x = self.dropout(x)  # (B, T, C)
        return x

    def _packed(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if set(batch) != {"input_ids", "position_ids"}:
            raise ValueError(f"a GPT input dict holds 'input_ids' and 'position_ids' (packed "
                             f"documents), got keys {sorted(batch)}; fix: "
                             "SampleDataset(..., boundaries=True) makes them")
        tokens, positions = batch["input_ids"], batch["position_ids"]
        if (tokens.dim() != 2 or positions.shape != tokens.shape or tokens.dtype.is_floating_point
                or positions.dtype.is_floating_point):
            raise TypeError(f"input_ids and position_ids must be integer tensors of one shape "
                            f"(batch, tokens), got {tokens.dtype} {tuple(tokens.shape)} and "
                            f"{positions.dtype} {tuple(positions.shape)}")
        if not torch.compiler.is_compiling() and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.context):
            raise ValueError(f"position_ids must lie in [0, {self.context}) (the model's "
                             f"context), got {int(positions.min())}..{int(positions.max())}")
        x: Tensor = self.dropout(self.token(tokens) + self.position(positions))  # (B, T, C)
        return x, positions


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which token ``t`` sees tokens ``0..t`` only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.residual_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        H = self.num_heads
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = attend(q, k, v, mask, p)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out: Tensor = self.residual_dropout(self.proj(y))  # (B, T, C)
        return out


class MLP(nn.Module):
    """The position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.gelu(self.fc(x))  # (B, T, 4C)
        x = self.dropout(self.proj(x))  # (B, T, C)
        return x


class Block(nn.Module):
    """Layers 1..L: a pre-LayerNorm transformer block, (B, T, C) -> (B, T, C) (packed
    documents: ``((B, T, C), position_ids)`` -> the same pair)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)
        # GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2L)
        for linear in (self.attn.qkv, self.attn.proj, self.mlp.fc, self.mlp.proj):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        for linear in (self.attn.proj, self.mlp.proj):
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * config.num_layers))

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        h, positions = _split_packed(x)
        mask = None if positions is None else document_mask(positions)
        h = h + self.attn(self.ln_1(h), mask)  # (B, T, C)
        h = h + self.mlp(self.ln_2(h))  # (B, T, C)
        return h if positions is None else (h, positions)


class Head(nn.Module):
    """Layer L + 1: final LayerNorm and projection to the vocabulary, (B, T, C) -> (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.width)
        self.proj = nn.Linear(config.width, config.vocab_size, bias=False)  # weight (V, C)
        nn.init.normal_(self.proj.weight, std=0.02)

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        logits: Tensor = self.proj(self.norm(_split_packed(x)[0]))  # (B, T, V)
        return logits


# --- layer factories -----------------------------------------------------------------


def gpt_layer(config: GPTConfig, *, seed: int, index: int) -> nn.Module:
    """Build layer ``index`` of the GPT, with initial weights that depend only on ``(seed, index)``.

    The tied token / output weights are drawn from ``seed`` alone, so layer 0 and layer
    ``L + 1`` get identical copies.

    Example:
        >>> config = GPTConfig(num_layers=2, width=32)
        >>> type(gpt_layer(config, seed=0, index=3)).__name__
        'Head'
    """
    num_indices = config.num_layers + 2
    if not 0 <= index < num_indices:
        raise ValueError(
            f"index={index} is out of range: a GPT with num_layers={config.num_layers} "
            f"has layers 0..{num_indices - 1}"
        )
    layer = seeded(functools.partial(_new_layer, config, index), seed=seed, index=index)
    if config.tie_embeddings and index in (0, num_indices - 1):
        tied = layer.get_parameter("token.weight" if index == 0 else "proj.weight")
        generator = torch.Generator().manual_seed(derive_seed(seed, "gpt.tied_token_weight"))
        with torch.no_grad():
            tied.normal_(std=0.02, generator=generator)
    return layer


def _new_layer(config: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(config)
    if index <= config.num_layers:
        return Block(config)
    return Head(config)


def gpt_layer_factories(config: GPTConfig, *, seed: int) -> list[LayerFactory]:
    """One picklable factory per layer: ``[Embedding, Block x num_layers, Head]``.

    Example:
        >>> factories = gpt_layer_factories(GPTConfig(num_layers=2, width=32), seed=0)
        >>> [type(factory()).__name__ for factory in factories]
        ['Embedding', 'Block', 'Block', 'Head']
    """
    return [
        functools.partial(gpt_layer, config, seed=seed, index=index)
        for index in range(config.num_layers + 2)
    ]


def gpt_ties(config: GPTConfig) -> list[Tie]:
    """The tied parameters as ``(layer index, parameter name)`` groups; empty when untied.

    Example:
        >>> gpt_ties(GPTConfig(num_layers=4))
        [((0, 'token.weight'), (5, 'proj.weight'))]
    """
    if not config.tie_embeddings:
        return []
    return [((0, "token.weight"), (config.num_layers + 1, "proj.weight"))]


def build_gpt(config: GPTConfig, *, seed: int) -> nn.Sequential:
    """The whole GPT in one process: the factories' layers in order, ties shared.

    Example:
        >>> model = build_gpt(GPTConfig(num_layers=2, width=32, context=16), seed=0)
        >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
        torch.Size([3, 16, 256])
    """
    return build_sequential(gpt_layer_factories(config, seed=seed), ties=gpt_ties(config))


# --- loss and sampling ---------------------------------------------------------------


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all tokens: logits (B, T, V), targets int64 (B, T) -> scalar.

    Example:
        >>> loss = gpt_loss(torch.zeros(2, 3, 256), torch.zeros(2, 3, dtype=torch.long))
        >>> round(loss.item(), 4)  # ln(256): uniform prediction
        5.5452
    """
    if logits.dim() < 2 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape "
            f"{tuple(targets.shape)}: expected logits (B, T, V) and targets (B, T)"
        )
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def generate(
    model: Callable[[Tensor], Tensor],
    prompt: Tensor,
    *,
    num_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    context: int | None = None,
) -> Tensor:
    """Extend ``prompt`` by ``num_tokens`` sampled tokens, one at a time.

    ``model`` is anything that maps token ids (B, T) to logits (B, T, V): a GPT from
    :func:`build_gpt` or a pipeline's forward. The input is cropped to the last
    ``context`` tokens; ``context`` is read from the model's :class:`Embedding` when not
    given (pass it for a callable, or the input is never cropped). ``temperature=0``
    picks the most likely token. Call ``model.eval()`` first when it has dropout.

    Returns ``prompt`` (shape (T,) or (B, T)) with the new tokens appended along T.

    Example:
        >>> model = build_gpt(GPTConfig(num_layers=1, width=32, context=8), seed=0)
        >>> prompt = torch.tensor([104, 105])
        >>> generate(model, prompt, num_tokens=10, generator=torch.Generator().manual_seed(0)).shape
        torch.Size([12])
    """
    problems = []
    if prompt.dim() not in (1, 2) or prompt.size(-1) == 0 or prompt.dtype.is_floating_point:
        problems.append(
            f"prompt must be non-empty integer token ids of shape (T,) or (B, T), got a "
            f"{prompt.dtype} tensor of shape {tuple(prompt.shape)}"
        )
    if num_tokens < 0:
        problems.append(f"num_tokens={num_tokens} must be >= 0")
    if temperature < 0:
        problems.append(f"temperature={temperature} must be >= 0 (0 picks the most likely token)")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k={top_k} must be >= 1, or None to sample from all tokens")
    if problems:
        raise ValueError("generate: " + "; ".join(problems))
    if context is None and isinstance(model, nn.Module):
        context = next((m.context for m in model.modules() if isinstance(m, Embedding)), None)

    tokens = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)  # (B, T)
    with torch.no_grad():
        for _ in range(num_tokens):
            window = tokens if context is None else tokens[:, -context:]  # (B, <= context)
            logits = model(window)  # (B, T, V)
            if logits.dim() != 3 or logits.shape[:2] != window.shape:
                raise ValueError(
                    f"model returned logits of shape {tuple(logits.shape)} for tokens of shape "
                    f"{tuple(window.shape)}: it must return (B, T, V)"
                )
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, -math.inf)
                probabilities = F.softmax(logits, dim=-1)  # (B, V)
                next_token = torch.multinomial(probabilities, 1, generator=generator)  # (B, 1)
            tokens = torch.cat([tokens, next_token.to(tokens.dtype)], dim=1)  # (B, T + 1)
    return tokens if prompt.dim() == 2 else tokens[0]
