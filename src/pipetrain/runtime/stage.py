"""One pipeline stage: its layers, and the autograd state of its micro-batches in flight.

A stage is a pure function of what it receives: ``(input, skips) -> (output, skips)``.
A micro-batch's graph ends at the stage boundary, on one-element holders that take the
gradients of the received tensors (:func:`~.in_flight.entered`: only the layers keep
their data); backward starts from the stage's outputs with the gradients the next stage
sent, and the gradients on the holders are what this stage sends back.

Re-materialization is explicit: a checkpointed micro-batch runs under ``no_grad`` and
keeps only what it received; :meth:`StageCompute.recompute` rebuilds its graph, and the
runtime calls it *before* waiting for the gradient, so the recomputation overlaps the
next stage's backward (as torchgpipe does). A split backward (input half, weight half)
recomputes once. Backward accumulates the weight gradients of linear layers in place
(:mod:`pipetrain.backward.fused`; ``fuse_weight_gradients=False`` leaves them to autograd).
With random streams (:class:`~pipetrain.runtime.rng.RandomStreams`) the stage runs its
layers one by one and seeds torch's generators before each from (seed, global layer
index, micro-batch), so the recomputation repeats dropout masks and the masks do not
depend on where the model is cut.

The message between stages ``j`` and ``j + 1`` is the stage output itself, or
``(output, [skip tensors])`` when skip connections cross the boundary (in the order of
:meth:`pipetrain.skip.SkipLayout.crossing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.backward.fused import fused_backward
from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.backward.roots import Root, backward_root, start_points
from pipetrain.backward.split import WeightGradient, backward_input
from pipetrain.checkpoint import enable_checkpointing, enable_recomputing
from pipetrain.nested import iter_tensors, map_tensors
from pipetrain.runtime.in_flight import InFlight, announce, entered, in_place_named
from pipetrain.runtime.offload import ActivationOffload
from pipetrain.runtime.per_layer import backward_by_layer, packed
from pipetrain.runtime.precision import stage_autocast
from pipetrain.runtime.rng import LayerHook, RandomStreams, seeding_hooks
from pipetrain.runtime.selective import selective_call
from pipetrain.runtime.shared_recompute import RecomputeSharing
from pipetrain.runtime.stage_loss import LOSS_NOTE, LossFn, stage_loss
from pipetrain.skip import SkipKey, Skippable, SkipTracker, run_with_skips, use_skip_tracker

__all__ = ["LOSS_NOTE", "LossFn", "StageCompute"]

class StageCompute:
    """Runs one stage's layers on micro-batches: forward, backward, split backward.

    ``skips_in`` / ``skips_out`` are the skip connections that arrive with the input /
    leave with the output (empty without skip connections). With ``rng`` every forward
    runs the layers of ``module`` (its children if it is an ``nn.Sequential``, else the
    module itself) one by one, layer ``l`` of them seeded as global layer
    ``first_layer + l`` (see :mod:`.rng`). With ``module_hooks`` a seeded forward still
    calls ``module`` as a whole, so that forward hooks registered on it fire (as
    torchgpipe calls each partition), its layers seeded from forward pre-hooks added for
    the call (about 10 us per layer). With ``autocast`` (a dtype) the forward, its
    recomputation and the loss run under ``torch.autocast`` (see :mod:`.precision`).

    Example:
        >>> stage = StageCompute(nn.Linear(2, 2), stage_index=0, device=torch.device("cpu"))
        >>> out, _ = stage.forward(0, torch.ones(1, 2, requires_grad=True), checkpointed=False)
        >>> grads = stage.backward(0, [torch.ones(1, 2)])
        >>> grads[0].shape
        torch.Size([1, 2])
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage_index: int,
        device: torch.device,
        skips_in: Sequence[SkipKey] = (),
        skips_out: Sequence[SkipKey] = (),
        loss_fn: LossFn | None = None,
        rng: RandomStreams | None = None,
        first_layer: int = 0,
        fuse_weight_gradients: bool = True,
        autocast: torch.dtype | None = None,
        module_hooks: bool = False,
        selective: bool = False,
        per_layer: bool = False,
    ) -> None:
        self.module = module
        self.selective = selective
        """Keep only the outputs of matrix products for backward and recompute the rest
        (:mod:`.selective`), in the forwards that are not checkpointed."""
        self.per_layer = per_layer
        """Re-materialize each layer on its own (:mod:`.per_layer`): a forward keeps every
        layer's input and its backward rebuilds one layer at a time, so a micro-batch
        holds its layers' inputs and a backward one layer's activations."""
        if per_layer and (skips_in or skips_out or any(
                isinstance(m, Skippable) for m in module.modules())):
            raise ValueError(
                f"checkpoint 'per_layer' on stage {stage_index}, whose layers have skip "
                "connections (a layer rebuilt alone cannot stash or pop); fix: "
                "checkpoint='always' for that stage")
        self.module_hooks = module_hooks
        self.stage_index = stage_index
        self.device = device
        self.skips_in = tuple(skips_in)
        self.skips_out = tuple(skips_out)
        self.loss_fn = loss_fn
        self.rng = rng
        self.first_layer = first_layer
        """Global index of the stage's first layer (the key of its random stream)."""
        self.layers = list(module) if isinstance(module, nn.Sequential) else [module]
        # fusion reads the saved inputs of linear layers, which a checkpointed region hands
        # out once, to autograd's backward
        self.fuse = fuse_weight_gradients and not (selective or per_layer)
        self.autocast = autocast
        """Autocast dtype of the forward, its recomputation and the loss (see
        :mod:`.precision`); ``None``: none."""
        self.gradient_pool = GradientPool()
        """Gradient buffers kept across optimizer steps (:meth:`release_gradients`)."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sharing: RecomputeSharing | None = None
        """Set by a single-process pipeline: lets idle workers of other stages run this
        stage's recomputations (see :mod:`.shared_recompute`)."""
        self.offload: ActivationOffload | None = None
        """Set to move the activations this stage saves for backward beyond a budget to
        host memory (:mod:`.offload`)."""
        self.before_backward: Callable[[int, int], None] | None = None
        """Called with ``(stage_index, micro-batch key)`` before each full backward (set by
        a pipeline whose data parallelism is FSDP2: its per-backward switches, see
        :mod:`pipetrain.api.fsdp`)."""
        self._in_flight: dict[int, InFlight] = {}
        self._weight: dict[int, WeightGradient] = {}
        self._in_backward = 0

    # -- forward ----------------------------------------------------------------------
    def _call(self, microbatch: int, value: Any, skips: dict[SkipKey, Any],
              keep: list[Any] | None = None) -> Any:
        if self.rng is None:
            return self._run(value, skips, None, keep)
        with self.rng.scope(stage=self.stage_index, microbatch=microbatch,
                            device=self.device) as enter:
            return self._run(value, skips, enter, keep)

    def _run(self, value: Any, skips: dict[SkipKey, Any], enter: LayerHook | None,
             keep: list[Any] | None = None) -> Any:
        """``(output, skips out)`` of the stage, its layers seeded one by one if ``enter``,
        each layer's input appended to ``keep`` if given."""
        if keep is not None:
            for index, layer in enumerate(self.layers, start=self.first_layer):
                keep.append(value)
                if enter is not None:
                    enter(index)
                value = layer(value)
            return value, {}
        if enter is None:
            if not self.skips_in and not self.skips_out:
                return self.module(value), {}
            return run_with_skips(self.module, value, skips)
        tracker = SkipTracker(skips)
        with use_skip_tracker(tracker):
            if self.module_hooks:
                with seeding_hooks(self.layers, enter, self.first_layer):
                    value = self.module(value)
            else:
                for index, layer in enumerate(self.layers, start=self.first_layer):
                    enter(index)
                    value = layer(value)
        return value, tracker.remaining()

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device, non_blocking=True)

    def _compute(
        self, microbatch: int, message: Any, target: Any, loss_scale: float | None,
        keep: list[Any] | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        if self.skips_in:
            value, skip_list = message
            skips = dict(zip(self.skips_in, skip_list))
        else:
            value, skips = message, {}
        with stage_autocast(self.device, self.autocast), in_place_named(self.stage_index):
            output, skips_out = self._call(microbatch, value, skips, keep)
            if self.skips_out:
                output = (output, [skips_out[key] for key in self.skips_out])
            loss = None
            if target is not None and self.loss_fn is not None:
                loss = stage_loss(self.loss_fn, output, target, stage_index=self.stage_index,
                                  scale=loss_scale)
        return output, loss

    def forward(
        self,
        microbatch: int,
        message: Any,
        *,
        checkpointed: bool,
        target: Any = None,
        loss_scale: float | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """Run micro-batch ``microbatch``; returns ``(message for the next stage, loss)``.

        ``loss`` is ``loss_fn(output, target) * loss_scale`` when this stage computes the
        loss (``target`` given), else ``None``. With autograd enabled the micro-batch's
        state is kept for its backward: its graph, or, if ``checkpointed``, only its
        inputs (the graph is rebuilt by :meth:`recompute`).
        """
        whole = torch.is_grad_enabled() and not checkpointed and not self.per_layer
        # the layers get the received data, its gradients going to holders (.in_flight)
        leaves, message = entered(message, self._to_device, enter=lambda t: whole)
        if target is not None:
            target = map_tensors(self._to_device, target)
        if not torch.is_grad_enabled():
            return self._compute(microbatch, message, target, loss_scale)
        if whole:
            with (self.offload.saving(microbatch) if self.offload is not None
                  else contextlib.nullcontext()):
                if self.selective:
                    output, loss = selective_call(self._compute, microbatch, message, target,
                                                  loss_scale, preserve_rng_state=self.rng is None)
                else:
                    output, loss = self._compute(microbatch, message, target, loss_scale)
            roots: list[Root | None] = [
                backward_root(t) for t in iter_tensors(output) if t.requires_grad
            ]
            self._in_flight[microbatch] = InFlight(leaves, roots, loss)
            return output, loss
        kept: list[Any] | None = [] if self.per_layer else None
        with torch.no_grad(), enable_checkpointing():
            output, loss = self._compute(microbatch, message, target, loss_scale, kept)
            kept = None if kept is None else packed(kept)
        # announce the outputs that will carry a gradient once recomputed
        differentiable = bool(leaves) or bool(self.params)
        output = map_tensors(
            lambda t: t.detach().requires_grad_(True) if announce(t, differentiable) else t,
            output,
        )
        announced = sum(1 for t in iter_tensors(output) if t.requires_grad)
        replay = (message, target, loss_scale)
        self._in_flight[microbatch] = (
            InFlight(leaves, [], None, layer_inputs=(kept, target, loss_scale))
            if kept is not None else InFlight(leaves, [None] * announced, None, replay=replay))
        return output, loss

    def recompute(self, microbatch: int) -> None:
        """Rebuild the graph of a checkpointed micro-batch (no-op otherwise), or wait for
        the worker that is rebuilding it (:attr:`sharing`)."""
        state = self._in_flight.get(microbatch)
        if state is None or state.replay is None:
            return
        if self.sharing is not None and self.sharing.active:
            self.sharing.recompute(self, microbatch)
        else:
            self.rebuild(microbatch)

    def graphs_held(self) -> int:
        """Micro-batches whose autograd graph this stage holds: kept from forward or
        rebuilt, in backward, or waiting for their weight half."""
        kept = sum(1 for state in list(self._in_flight.values()) if state.replay is None)
        return kept + self._in_backward + len(self._weight)

    @property
    def touches_generators(self) -> bool:
        """Whether this stage's forward seeds torch's (process-wide) generators."""
        return self.rng is not None and self.rng.touches_generators(self.stage_index)

    def pending_recomputations(self) -> list[int]:
        """Keys of the checkpointed micro-batches whose graph is not rebuilt yet."""
        return [k for k, state in list(self._in_flight.items()) if state.replay is not None]

    def rebuild(self, microbatch: int) -> None:
        """Recompute a checkpointed micro-batch's forward with autograd (any thread)."""
        state = self._in_flight.get(microbatch)
        if state is None or state.replay is None:
            return
        message, target, loss_scale = state.replay
        with torch.enable_grad(), enable_recomputing():
            # a copy to another device (no leaf) sends its gradient back through the copy
            holders, message = entered(message, lambda t: t, enter=lambda t: t.grad_fn is None)
            output, loss = self._compute(microbatch, message, target, loss_scale)
        state.inputs = [o if h.grad_fn is not None else h for o, h in zip(state.inputs, holders)]
        differentiable = bool(state.inputs) or bool(self.params)
        # the positions announced at forward time; one that turns out to need no
        # gradient (nothing trainable behind it) is skipped in backward
        state.outputs = [backward_root(t) if t.requires_grad else None
                         for t in iter_tensors(output) if announce(t, differentiable)]
        state.loss = loss
        state.replay = None

    # -- backward ---------------------------------------------------------------------
    def _targets(
        self, state: InFlight, grads: Sequence[torch.Tensor | None] | None
    ) -> tuple[list[Root], list[torch.Tensor | None]]:
        if state.loss is not None:
            return [state.loss], [None]
        if grads is None:
            raise RuntimeError(
                f"stage {self.stage_index} got no output gradients and computes no loss"
            )
        if len(grads) != len(state.outputs):
            raise RuntimeError(
                f"stage {self.stage_index} has {len(state.outputs)} outputs that need a "
                f"gradient but received {len(grads)} gradients"
            )
        pairs = [(t, g) for t, g in zip(state.outputs, grads) if g is not None and t is not None]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _take(self, microbatch: int) -> InFlight:
        try:
            return self._in_flight.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage_index}: backward of micro-batch {microbatch} without its "
                "forward (or twice); in flight: "
                f"{sorted(self._in_flight)}"
            ) from None

    @contextlib.contextmanager
    def _backward_of(
        self, microbatch: int, grads: Sequence[torch.Tensor | None] | None
    ) -> Iterator[tuple[InFlight, list[Root], list[torch.Tensor | None]]]:
        """The state of ``microbatch`` (rebuilt if checkpointed) and its backward targets,
        counted in :meth:`graphs_held` until the block ends."""
        self.recompute(microbatch)
        self._in_backward += 1  # before the take: a helper never sees one graph too few
        try:
            state = self._take(microbatch)
            if state.layer_inputs is not None:
                yield state, [], []  # its layers start their own backward
            else:
                yield (state, *self._targets(state, grads))
        finally:
            self._in_backward -= 1
            if self.sharing is not None:
                self.sharing.freed()

    def backward(
        self, microbatch: int, grads: Sequence[torch.Tensor | None] | None
    ) -> list[torch.Tensor | None]:
        """Full backward of a micro-batch: weight gradients accumulate into ``.grad``;
        returns the gradients of the received tensors that require grad."""
        with self._backward_of(microbatch, grads) as (state, tensors, grad_tensors):
            if self.before_backward is not None:
                self.before_backward(self.stage_index, microbatch)
            try:
                if state.layer_inputs is not None:
                    self._backward_by_layer(microbatch, state, grads)
                    return [leaf.grad for leaf in state.inputs]
                if not tensors:
                    return [None] * len(state.inputs)
                if self.fuse and self.autocast is None:  # autocast's casts leave nothing to fuse
                    return fused_backward(tensors, grad_tensors, state.inputs, self.params,
                                          pool=self.gradient_pool)
                torch.autograd.backward(start_points(tensors, grad_tensors))
                return [leaf.grad for leaf in state.inputs]
            finally:
                if self.offload is not None:
                    self.offload.release(microbatch)

    def _backward_by_layer(self, microbatch: int, state: InFlight,
                           grads: Sequence[torch.Tensor | None] | None) -> None:
        """The backward of a micro-batch of a per-layer stage (:mod:`.per_layer`)."""
        assert state.layer_inputs is not None
        inputs, target, loss_scale = state.layer_inputs
        differentiable = bool(state.inputs) or bool(self.params)
        last = len(self.layers) - 1

        def run_layer(k: int, value: Any) -> tuple[Any, torch.Tensor | None]:
            with stage_autocast(self.device, self.autocast), (
                    self.rng.scope(stage=self.stage_index, microbatch=microbatch,
                                   device=self.device)
                    if self.rng is not None else contextlib.nullcontext()) as enter:
                if enter is not None:
                    enter(self.first_layer + k)
                output = self.layers[k](value)
                loss = None
                if k == last and target is not None and self.loss_fn is not None:
                    loss = stage_loss(self.loss_fn, output, target,
                                      stage_index=self.stage_index, scale=loss_scale)
            return output, loss

        backward_by_layer(inputs, grads, run_layer=run_layer,
                          announced=lambda t: announce(t, differentiable))

    def backward_input(
        self, microbatch: int, grads: Sequence[torch.Tensor | None] | None
    ) -> list[torch.Tensor | None]:
        """Input-gradient half of the backward; the weight half waits for
        :meth:`backward_weight`. A :attr:`selective` or :attr:`per_layer` stage runs its whole
        backward here (torch's checkpoint allows one backward per region) and nothing later."""
        if self.selective or self.per_layer:
            input_grads = self.backward(microbatch, grads)
            self._weight[microbatch] = WeightGradient()  # nothing owed
            return input_grads
        with self._backward_of(microbatch, grads) as (state, tensors, grad_tensors):
            input_grads, weight = backward_input(
                tensors, grad_tensors, state.inputs, self.params, fuse=self.fuse,
                pool=self.gradient_pool,
            )
            self._weight[microbatch] = weight  # still counted: the weight half holds it
        return input_grads

    def backward_weight(self, microbatch: int) -> None:
        """Weight-gradient half of the backward of a micro-batch."""
        try:
            weight = self._weight.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage_index}: weight backward of micro-batch {microbatch} "
                "before its input backward"
            ) from None
        weight.run()
        if self.offload is not None:
            self.offload.release(microbatch)
        if self.sharing is not None:
            self.sharing.freed()

    def prefetch(self, microbatch: int) -> None:
        """Start bringing ``microbatch``'s offloaded activations back (its backward is next)."""
        if self.offload is not None:
            self.offload.prefetch(microbatch)

    def release_gradients(self) -> None:
        """Set the stage's ``.grad`` to ``None`` (as ``zero_grad()`` does), keeping the
        buffers for the next step's backward."""
        self.gradient_pool.release(self.params)

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward has not finished."""
        return len(self._in_flight) + len(self._weight)

    def drop(self, low: int, high: int) -> None:
        """Forget the micro-batches with keys in ``[low, high)`` (their backward will not come)."""
        for table in (self._in_flight, self._weight):
            for key in [k for k in table if low <= k < high]:
                table.pop(key, None)
                if self.offload is not None:
                    self.offload.release(key)

    def reset(self) -> None:
        """Drop every micro-batch's state (after a failed step)."""
        self._in_flight.clear()
        self._weight.clear()
        if self.offload is not None:
            self.offload.clear()
