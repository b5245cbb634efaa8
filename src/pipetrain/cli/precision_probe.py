"""Does ``--precision bf16|fp16`` pay off on this CPU? A short probe before the workers start.

Mixed precision is a GPU feature first: on a CPU, whether bf16 or fp16 math is fast
depends on the instructions the CPU has and on which kernels torch has for each op (a
matrix product may run in fast bf16 while layer norm, attention or the loss run slowly
in it). Flags in ``/proc/cpuinfo`` do not tell: this project's 2-core AMD EPYC reports
``avx512_bf16``, and its GPT still trained 7.6x slower in bf16. So the launcher times a
few steps of the ops of a transformer block (linear layers, layer norm, attention,
GELU, cross-entropy; forward and backward) at the run's width and context, in float32
and under the chosen autocast, and warns when the chosen precision is slower.
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

__all__ = ["precision_slowdown", "precision_warning"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _block_step(x: torch.Tensor, weights: list[torch.Tensor], heads: int) -> torch.Tensor:
    batch, context, width = x.shape
    h = F.layer_norm(x, (width,))
    q, k, v = torch.split(F.linear(h, weights[0]), width, dim=-1)
    q, k, v = (t.view(batch, context, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape_as(x)
    x = x + F.linear(a, weights[1])
    x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (width,)), weights[2])), weights[3])
    logits = F.linear(x, weights[4])
    return F.cross_entropy(logits.flatten(0, 1), torch.zeros(batch * context, dtype=torch.long))


def _seconds(precision: str | None, *, width: int, context: int, heads: int, batch: int,
             repetitions: int) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, context, width, generator=generator, requires_grad=True)
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width),
              (256, width)]
    weights = [(torch.randn(*s, generator=generator) * 0.02).requires_grad_() for s in shapes]
    times = []
    for _ in range(repetitions + 1):
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=_DTYPES.get(precision or "", torch.float32),
                            enabled=precision is not None):
            loss = _block_step(x, weights, heads)
        torch.autograd.backward(loss)
        times.append(time.perf_counter() - began)
    return sorted(times[1:])[len(times[1:]) // 2]


def precision_slowdown(precision: str, *, width: int, context: int, heads: int,
                       batch: int = 4, repetitions: int = 5) -> float:
    """How many times slower a transformer block's step runs in ``precision`` (``bf16``,
    ``fp16``) than in float32 on this CPU (median of ``repetitions``; under 1: faster).

    Example:
        >>> precision_slowdown("bf16", width=32, context=16, heads=2) > 0
        True
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {sorted(_DTYPES)}")
    heads = heads if width % heads == 0 else 1
    kwargs = {"width": width, "context": context, "heads": heads, "batch": batch,
              "repetitions": repetitions}
    plain = _seconds(None, **kwargs)
    chosen = _seconds(precision, **kwargs)
    return chosen / plain if plain > 0 else 1.0


def precision_warning(config: object) -> str | None:
    """The warning for a run whose ``--precision`` is slower than fp32 on this CPU (more
    than 1.2x on the probe), or None (fp32, a GPU, or a precision that pays off here)."""
    precision = getattr(config, "precision", "fp32")
    if precision not in _DTYPES or torch.cuda.is_available():
        return None
    width, heads = int(getattr(config, "width", 64)), int(getattr(config, "heads", 4))
    context = int(getattr(config, "context", 128))
    slowdown = precision_slowdown(precision, width=width, context=context, heads=heads)
    if slowdown <= 1.2:
        return None
    return (f"--precision {precision} is slower than fp32 on this CPU: {slowdown:.1f}x on a probe "
            f"of a transformer block's ops at --width {width} --context {context} (torch's CPU "
            f"kernels for some of them are not faster in {precision} here); --precision fp32 "
            "trains faster on this machine (mixed precision pays off on GPUs)")
