"""Per-layer costs for balancing a layer sequence, as torchgpipe's balancers measure them.

Two measurements of the profiler, for :func:`pipetrain.partition.balance_by_time` and
``balance_by_size`` (which cut the model by them with
:func:`pipetrain.plan.contiguous.solve`):

- :func:`profile_times`: each layer's forward and backward seconds, the profile's
  ``compute_s`` (:class:`~pipetrain.plan.profile.LayerProfile`), timed in order, pass
  after pass for a time budget (:func:`~pipetrain.plan.measure.time_in_order`), so that
  ``@skippable`` stash and pop layers run as in a plain forward;
- :func:`profile_sizes`: torchgpipe's size weights: what a forward on one sample leaves
  allocated, in CUDA's 512-byte blocks (:func:`~pipetrain.plan.memory.latent_bytes`),
  scaled to a micro-batch, plus the parameters' bytes times ``param_scale``.

Each layer runs on a copy placed on the profiling device (built layer by layer, so the
whole model never has to be there), in training mode, on the previous layer's output.
The module itself is left untouched: its parameters, gradients, buffers (batch norm
statistics) and device stay as they were, and so does the caller's random state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipetrain.microbatch import batch_size
from pipetrain.plan.measure import Pass, median_time, time_in_order
from pipetrain.plan.memory import latent_bytes, storage_bytes
from pipetrain.plan.profiler import TIME_DIGITS
from pipetrain.plan.profiler_inputs import (
    LayerSource,
    build_layer,
    first_rows,
    layer_sources,
    measuring,
)

__all__ = ["profile_sizes", "profile_times"]

_logger = logging.getLogger(__name__)


def profile_times(
    module: nn.Sequential | Iterable[LayerSource],
    sample: Any,
    *,
    timeout: float,
    device: torch.device,
) -> list[float]:
    """Seconds of forward + backward of each layer on ``sample``: the median forward
    plus the median backward over passes in order, repeated until ``timeout`` seconds
    have gone by (at least one pass), each rounded as the profiler rounds its times.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> times = profile_times(model, torch.randn(4, 8), timeout=0.0,
        ...                       device=torch.device("cpu"))
        >>> len(times), all(t >= 0 for t in times)
        (2, True)
    """
    builders = [functools.partial(build_layer, j, source, device=device)
                for j, source in enumerate(layer_sources(module))]
    with measuring(device):
        timings = time_in_order(builders, sample, device=device, timeout=timeout)
    return [median_time(t.forward, digits=TIME_DIGITS) + median_time(t.backward, digits=TIME_DIGITS)
            for t in timings]


def profile_sizes(
    module: nn.Sequential | Iterable[LayerSource],
    input: Any,
    *,
    chunks: int,
    param_scale: float,
    device: torch.device,
) -> list[int]:
    """Bytes each layer needs in training, weighed as torchgpipe weighs them on CUDA.

    Each layer runs (in training mode, on a copy) on one sample: the first row of
    every batch tensor of ``input``, fed the previous layer's output. Its *latent*
    size is the memory that forward leaves allocated (output and saved tensors, new
    storages only, in CUDA's 512-byte blocks), scaled to one micro-batch by
    ``batch size / chunks``; its parameters count ``param_scale`` times their bytes.
    This is what torchgpipe's ``balance_by_size`` reads from
    ``torch.cuda.memory_allocated``, computed from the tensors themselves, so the
    weights (and the balance) are the same on the CPU as on CUDA. Buffers are not
    counted, as in torchgpipe. A model with a layer that cannot run on one sample in
    training (``BatchNorm1d`` on ``(N, C)`` inputs, which torchgpipe cannot profile)
    is weighed on two samples, halved.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> # Linear: a 16-byte output row in a 512-byte block, x 8 rows / 2 chunks,
        >>> # plus 2 x 80 parameter bytes; ReLU: its output row (which it saves)
        >>> profile_sizes(model, torch.randn(8, 4, requires_grad=True), chunks=2,
        ...               param_scale=2.0, device=torch.device("cpu"))
        [2208, 2048]
    """
    sources = layer_sources(module)
    size = batch_size(input)
    try:
        measured = _weigh(sources, first_rows(input, 1), device)
    except Exception as error:  # e.g. BatchNorm1d on (1, C): needs more than one row
        if size < 2:
            raise
        _logger.info("a layer cannot run on one sample (%s); weighing two samples, "
                     "per sample", error)
        measured = [(latent / 2, params)
                    for latent, params in _weigh(sources, first_rows(input, 2), device)]
    latent_scale = size / chunks
    return [int(latent * latent_scale + params * param_scale) for latent, params in measured]


def _weigh(sources: list[LayerSource], sample: Any,
           device: torch.device) -> list[tuple[float, int]]:
    """(latent bytes, parameter bytes) of each layer, run on ``sample`` in order."""
    value = sample
    measured: list[tuple[float, int]] = []
    with measuring(device):
        for j, source in enumerate(sources):
            layer = build_layer(j, source, device=device)
            run = Pass.prepare(value, device)
            latent, run.output = latent_bytes(layer, run.value)
            measured.append((latent, storage_bytes(layer.parameters())))
            value = run.detached_output()
    return measured
