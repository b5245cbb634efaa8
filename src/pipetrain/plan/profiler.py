"""The profiler: each layer's time and memory, measured on its device, as a :class:`Profile`.

:func:`profile_model` builds the layers one at a time (a deep copy of a given module,
or a new layer from a factory), moves it to the device, runs it in training mode on the
previous layer's output (the first on ``sample``), measures it and frees it, so a model
too big for the device is profiled layer by layer. The first layer's input needs a
gradient only where ``sample``'s tensors do (a first stage receives no gradient); every
later input needs one where the previous output did. What each field counts:

``forward_s``
    a forward of the layer on ``batch_size`` samples; the last layer's includes
    ``loss_fn(output, target)`` when given, as the last pipeline stage computes it.
``backward_s``
    the whole backward, as the runtime runs it
    (:func:`pipetrain.backward.fused.fused_backward`), from a gradient of ones
    for every output that needs one (the last layer with ``loss_fn``: from the loss).
``backward_input_s`` / ``backward_weight_s``
    the input-gradient pass (:func:`pipetrain.backward.split.backward_input`)
    and the deferred weight-gradient pass it returns, as zero-bubble schedules run them.
    Without trainable parameters: the whole backward and 0.
``output_bytes``
    every tensor of the output, ``numel * element_size`` each (what crosses a cut).
``parameter_bytes`` / ``gradient_bytes``
    the layer's distinct parameters (frozen ones too; buffers are not counted), and the
    ``.grad`` tensors its backward produced (trainable parameters that got a gradient).
``optimizer_bytes``
    the state that one real ``step()`` of the chosen optimizer creates for the layer's
    trainable parameters, each storage once, leaving out 0-dim tensors (Adam's ``step``
    counter): ``"sgd"`` 0 (SGD with momentum, e.g. ``functools.partial(torch.optim.SGD,
    lr=0.1, momentum=0.9)``: the momentum buffer, 1x), ``"adam"`` / ``"adamw"`` 2x the
    trainable parameters. The step runs on the profiler's copy, after the timings.
``optimizer_step_s``
    one ``step()`` of a new optimizer of that kind over those parameters (after an
    untimed first step, which creates its state): the step a stage runs once per step.
``saved_bytes``
    the tensors the forward (and the last layer's ``loss_fn``) saves for the backward,
    seen through :class:`torch.autograd.graph.saved_tensors_hooks`, each storage once,
    leaving out the layer's parameters and buffers and the input tensors that the
    previous layer already counted (it saved them as its own output): a ``Linear``
    after a ``ReLU`` counts 0 (its input is the ReLU's saved output), after another
    ``Linear`` its input's bytes. So the ``saved_bytes`` of consecutive layers add up to
    what they keep together, each storage once, but for the run's input where the layer
    before the run counted it (a stage also holds its input and output in flight).
    Tied parameters (GPT's embedding and head) count in each layer that holds them.
``backward_workspace_bytes`` / ``backward_input_workspace_bytes``
    the most memory the whole backward (and, for a layer with trainable parameters, the
    input-gradient pass of the split backward) needs above what the layer holds when it
    starts: every storage the pass creates counted until freed, the saved activations it
    frees counted off, the parameters' gradients left out (a pipeline keeps them between
    steps). :class:`~pipetrain.plan.memory.TransientBytes` counts them; the simulator adds
    them to a stage's held activations while its backward runs.

Sizes are for ``batch_size`` samples; ``microbatch_size``, when given, adds the four
``microbatch_*_s`` times measured on its first ``microbatch_size`` samples (small
batches use the device less efficiently than a linear scaling suggests).

Noise: every time is the median of ``repetitions`` timed rounds after ``warmup``
untimed ones (a layer with parameters times two forwards per round), with Python's
garbage collector paused while a layer is timed and a CUDA device synchronized around
every timed region. On the CPU, a repetition during which the process lost the CPU for
over a quarter of it (another process ran: its CPU time falls short of its wall time)
is left out of the median, unless all were. The medians are rounded to 3 significant
digits, so that identical layers get identical times and the planner's tie-breaking,
not noise, picks among equal cuts. The caller's random state is left untouched.

Example:
    The default GPT of ``pipetrain train`` and its loss, on a batch of the default corpus:

    >>> from pipetrain.data import TextDataset, load_corpus
    >>> from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss
    >>> config = GPTConfig(num_layers=2, width=32, context=16)
    >>> tokens, targets = TextDataset(load_corpus(max_bytes=100_000), context=16,
    ...                               seed=0).batch(0, 8)
    >>> profile = profile_model(gpt_layer_factories(config, seed=0), tokens,
    ...                         microbatch_size=2, loss_fn=gpt_loss, target=targets,
    ...                         device="cpu", warmup=0, repetitions=1)
    >>> [layer.description for layer in profile.layers]
    ['Embedding', 'Block', 'Block', 'Head']
    >>> profile.layers[0].output_bytes == 8 * 16 * 32 * 4
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.backward.split import backward_input
from pipetrain.microbatch import batch_size as rows_of
from pipetrain.nested import iter_tensors, map_tensors
from pipetrain.plan.measure import (
    LossFn,
    Pass,
    Timings,
    cache_flush_buffer,
    median_time,
    relative_spread,
    time_layer,
    time_optimizer_step,
)
from pipetrain.plan.memory import (
    OPTIMIZERS,
    OptimizerFactory,
    SavedTensors,
    TransientBytes,
    optimizer_state_bytes,
    storage_bytes,
    storage_key,
)
from pipetrain.plan.profile import LayerProfile, Profile, model_identity
from pipetrain.plan.profiler_inputs import (
    LayerSource,
    build_layer,
    check_settings,
    default_device,
    first_rows,
    layer_sources,
    measuring,
)

__all__ = ["TIME_DIGITS", "LayerSignature", "LayerSource", "identify_model", "layer_signature",
           "profile_model"]

_logger = logging.getLogger(__name__)

TIME_DIGITS = 3
"""Significant digits kept of every measured time."""


@dataclass(frozen=True)
class _Settings:
    device: torch.device
    dtype: torch.dtype | None
    optimizer: OptimizerFactory
    warmup: int
    repetitions: int
    loss_fn: LossFn | None
    targets: tuple[Any, Any]
    """The target at the batch size and at the micro-batch size."""
    flush: torch.Tensor | None = None
    """The buffer whose writes evict a layer's optimizer state from the CPU's caches
    (one for every layer: each new one would be page-faulted in again)."""


class _Shown(str):
    """Text that shows as itself inside a container's repr."""

    def __repr__(self) -> str:
        return str(self)


def _describe(value: Any, limit: int = 200) -> str:
    """``value`` with its tensors shown as ``Tensor(dtype, shape)``, for error messages."""
    text = repr(map_tensors(
        lambda t: _Shown(f"Tensor({str(t.dtype).removeprefix('torch.')}, {tuple(t.shape)})"),
        value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _optimizer_name(optimizer: str | OptimizerFactory) -> str:
    if isinstance(optimizer, str):
        return optimizer
    return str(getattr(getattr(optimizer, "func", optimizer), "__name__", "custom")).lower()


def _description(layer: nn.Module) -> str:
    extra = layer.extra_repr()
    return type(layer).__name__ + (f"({extra})" if extra and "\n" not in extra else "")


@dataclass
class _Memory:
    output_bytes: int
    saved_bytes: int
    output_counted: list[bool]
    """Per output tensor: whether this layer's (or an earlier one's) saved_bytes holds it."""
    output: Any
    dtype: torch.dtype | None
    """The dtype of the layer's first floating-point parameter."""
    backward_workspace: int = 0
    input_workspace: int = 0
    """Of the split backward's input pass; without trainable parameters, the whole one's."""


def _measure_memory(index: int, name: str, layer: nn.Module, value: Any,
                    input_counted: Sequence[bool], settings: _Settings,
                    loss_fn: LossFn | None) -> _Memory:
    """One forward under saved-tensor hooks, then one backward (which makes ``.grad``)."""
    run = Pass.prepare(value, settings.device)
    counted_inputs = {storage_key(t) for t, counted in zip(iter_tensors(run.value), input_counted)
                      if counted}
    exclude = counted_inputs | {storage_key(t) for t in (*layer.parameters(), *layer.buffers())}
    with SavedTensors() as saved:
        try:
            run.output = layer(run.value)
        except Exception as error:
            fix = ("pass a sample that layer 0 accepts, with the batch in dim 0" if index == 0
                   else f"make layer {index - 1}'s output what layer {index} takes")
            raise ValueError(
                f"layer {index} ({name}) failed on its input {_describe(run.value)}: "
                f"{type(error).__name__}: {error}; fix: {fix}"
            ) from error
        try:
            run.start_backward(loss_fn, settings.targets[0])
        except Exception as error:
            raise ValueError(
                f"loss_fn failed on the output of the last layer {index} ({name}), "
                f"{_describe(run.output)}, and the target {_describe(settings.targets[0])}: "
                f"{type(error).__name__}: {error}"
            ) from error
    held = ({storage_key(t) for t in saved.tensors} - exclude) | counted_inputs
    floating = [p.dtype for p in layer.parameters() if p.is_floating_point()]
    memory = _Memory(
        output_bytes=sum(t.numel() * t.element_size() for t in iter_tensors(run.output)),
        saved_bytes=storage_bytes(saved.tensors, exclude=exclude),
        output_counted=[storage_key(t) in held for t in iter_tensors(run.output)],
        output=run.detached_output(),
        dtype=floating[0] if floating else None,
    )
    trainable = [p for p in layer.parameters() if p.requires_grad]
    with TransientBytes(released=saved.tensors) as region:
        saved.tensors.clear()
        run.backward(trainable)
    memory.backward_workspace = region.peak(kept=[p.grad for p in trainable])
    memory.input_workspace = (_input_pass_workspace(layer, value, trainable, settings, loss_fn)
                              if trainable else memory.backward_workspace)
    return memory


def _input_pass_workspace(layer: nn.Module, value: Any, trainable: list[nn.Parameter],
                          settings: _Settings, loss_fn: LossFn | None) -> int:
    """The temporary bytes of the split backward's input-gradient pass (with what it keeps
    for the weight pass), the layer's gradients already allocated."""
    run = Pass.prepare(value, settings.device)
    with SavedTensors() as saved:
        run.forward(layer, loss_fn, settings.targets[0])
    with TransientBytes(released=saved.tensors) as region:
        saved.tensors.clear()
        _, weight = backward_input(run.roots, run.grads, run.leaves, trainable)
    workspace = region.peak(kept=[p.grad for p in trainable])
    weight.run()
    return int(workspace)


def _times(timings: Timings, has_weights: bool, prefix: str) -> dict[str, float]:
    backward = median_time(timings.backward, digits=TIME_DIGITS)
    return {
        f"{prefix}forward_s": median_time(timings.forward, digits=TIME_DIGITS),
        f"{prefix}backward_s": backward,
        f"{prefix}backward_input_s":
            median_time(timings.backward_input, digits=TIME_DIGITS) if has_weights else backward,
        f"{prefix}backward_weight_s":
            median_time(timings.backward_weight, digits=TIME_DIGITS) if has_weights else 0.0,
    }


def _profile_layer(index: int, source: LayerSource, value: Any, micro_value: Any,
                   input_counted: Sequence[bool], settings: _Settings, *, last: bool,
                   ) -> tuple[LayerProfile, _Memory, Any, LayerSignature]:
    """Build, measure and free one layer; its profile, memory pass, micro-batch output and
    signature."""
    layer = build_layer(index, source, device=settings.device, dtype=settings.dtype)
    signature = layer_signature(layer)
    name = _description(layer)
    loss_fn = settings.loss_fn if last else None
    memory = _measure_memory(index, name, layer, value, input_counted, settings, loss_fn)
    params = list(layer.parameters())
    has_weights = any(p.requires_grad for p in params)

    def timed(value: Any, target: Any) -> tuple[Timings, Any]:
        return time_layer(layer, value, device=settings.device, warmup=settings.warmup,
                          repetitions=settings.repetitions, loss_fn=loss_fn, target=target)

    measured = timed(value, settings.targets[0])[0]
    times = _times(measured, has_weights, "")
    spread = max(relative_spread(measured.forward), relative_spread(measured.backward))
    micro_output = None
    if micro_value is not None:
        try:
            micro, micro_output = timed(micro_value, settings.targets[1])
        except Exception as error:
            raise ValueError(
                f"layer {index} ({name}) failed on a micro-batch {_describe(micro_value)}: "
                f"{type(error).__name__}: {error}; fix: a larger microbatch_size"
            ) from error
        times |= _times(micro, has_weights, "microbatch_")
        spread = max(relative_spread(micro.forward), relative_spread(micro.backward))
    trainable = [p for p in params if p.requires_grad]
    record = LayerProfile(
        name=str(index),
        description=name,
        output_bytes=memory.output_bytes,
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        gradient_bytes=sum(p.grad.numel() * p.grad.element_size()
                           for p in params if p.grad is not None),
        optimizer_bytes=optimizer_state_bytes(trainable, settings.optimizer),
        optimizer_step_s=median_time(time_optimizer_step(
            trainable, settings.optimizer, device=settings.device, warmup=settings.warmup,
            repetitions=settings.repetitions, flush=settings.flush), digits=TIME_DIGITS),
        saved_bytes=memory.saved_bytes,
        backward_workspace_bytes=memory.backward_workspace,
        backward_input_workspace_bytes=memory.input_workspace,
        spread=spread,
        **times,
    )
    _logger.debug("profiled layer %d: %s", index, record)
    return record, memory, micro_output, signature


LayerSignature = tuple[str, list[tuple[str, tuple[int, ...]]]]
"""A layer's kind (class name) and its parameters' names and shapes."""


def layer_signature(layer: nn.Module) -> LayerSignature:
    """What :func:`~pipetrain.plan.profile.model_identity` takes of one layer.

    Example:
        >>> layer_signature(nn.Linear(3, 2))
        ('Linear', [('weight', (2, 3)), ('bias', (2,))])
    """
    kind = type(layer).__name__
    if isinstance(layer, nn.Sequential):
        kind += f"({', '.join(type(child).__name__ for child in layer)})"
    return kind, [(name, tuple(p.shape)) for name, p in layer.named_parameters()]


def identify_model(layers: nn.Sequential | Iterable[LayerSource], *, name: str = "") -> dict[str, Any]:
    """The identity of a sequential model (:func:`~pipetrain.plan.profile.model_identity`),
    each factory's layer built on the meta device (no memory, no weights).

    Example:
        >>> identify_model([lambda: nn.Linear(3, 2)] * 2)["summary"]
        '2 layers (2 x Linear), 16 parameters'
    """
    signatures = []
    for source in layer_sources(layers):
        if isinstance(source, nn.Module):
            signatures.append(layer_signature(source))
            continue
        with torch.device("meta"):
            signatures.append(layer_signature(source()))
    return model_identity(signatures, name=name)


def profile_model(
    layers: nn.Sequential | Iterable[LayerSource],
    sample: Any,
    *,
    batch_size: int | None = None,
    microbatch_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str | OptimizerFactory = "adamw",
    warmup: int = 2,
    repetitions: int = 5,
    loss_fn: LossFn | None = None,
    target: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure every layer of a sequential model (see the module docstring for the fields).

    ``sample`` is an input batch (a tensor or a nested value, batch in dim 0); the first
    ``batch_size`` rows are used (default: all). ``device`` defaults to the current CUDA
    device if there is one, else the CPU; ``dtype`` converts the layers and ``sample``'s
    floating-point tensors. ``optimizer`` is ``"sgd"``, ``"adam"``, ``"adamw"`` or a
    callable that builds one from a parameter list. ``loss_fn(output, target)`` gives the
    last layer's backward a loss (without it: a gradient of ones). ``progress(done,
    total)`` is called as each layer's measurement ends.

    Raises:
        ValueError: no layers, a bad setting (all are reported at once), a layer that
            fails on its input (the message names the layer's index and the input's
            dtypes and shapes), or a ``loss_fn`` that fails or returns no scalar.
        TypeError: ``layers`` is not a sequence of modules or factories.

    Example:
        >>> profile = profile_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
        ...                         torch.randn(4, 8), device="cpu", optimizer="adam")
        >>> [(layer.parameter_bytes, layer.optimizer_bytes) for layer in profile.layers]
        [(288, 576), (0, 0)]
        >>> profile.layers[1].backward_weight_s
        0.0
    """
    sources = layer_sources(layers)
    rows = rows_of(sample)
    check_settings(rows, batch_size, microbatch_size, warmup, repetitions, optimizer, loss_fn, target)
    size = rows if batch_size is None else batch_size
    device = torch.device(device) if device is not None else default_device()
    if dtype is not None:
        sample = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, sample)
    full = first_rows(sample, size)
    micro = first_rows(sample, microbatch_size) if microbatch_size is not None else None

    def on_device(value: Any) -> Any:
        return map_tensors(lambda t: t.to(device), value)

    settings = _Settings(
        device=device, dtype=dtype, warmup=warmup, repetitions=repetitions, loss_fn=loss_fn,
        optimizer=optimizer if callable(optimizer) else OPTIMIZERS[optimizer],
        targets=(on_device(first_rows(target, size)),
                 on_device(first_rows(target, microbatch_size or size))),
        flush=cache_flush_buffer() if device.type == "cpu" else None,
    )
    _logger.debug("profiling %d layers on %s at batch size %d", len(sources), device, size)
    records: list[LayerProfile] = []
    signatures: list[LayerSignature] = []
    first_dtype = dtype
    counted: Sequence[bool] = [False] * len(list(iter_tensors(full)))
    with measuring(device):
        for index, source in enumerate(sources):
            record, memory, micro, signature = _profile_layer(
                index, source, full, micro, counted, settings, last=index == len(sources) - 1)
            records.append(record)
            signatures.append(signature)
            full, counted = memory.output, memory.output_counted
            first_dtype = first_dtype or memory.dtype
            if progress is not None:
                progress(index + 1, len(sources))
    return Profile(
        layers=tuple(records),
        device=str(device),
        dtype=str(first_dtype or torch.get_default_dtype()).removeprefix("torch."),
        batch_size=size,
        microbatch_size=microbatch_size,
        torch_version=torch.__version__,
        optimizer=_optimizer_name(optimizer),
        source="pipetrain",
        model=model_identity(signatures),
        metadata={"warmup": warmup, "repetitions": repetitions, "time_digits": TIME_DIGITS,
                  **({"device_name": torch.cuda.get_device_name(device)}
                     if device.type == "cuda" else {})},
    )
